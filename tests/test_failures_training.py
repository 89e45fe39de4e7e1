"""Failures in what training holds: a checkpoint a rank cannot use, a loss that went NaN. Each names its rank."""

import os

import pytest
import torch

import toolkit
from toolkit import comm
from toolkit.runtime import RankError

pytestmark = pytest.mark.timeout(120)


def test_a_refused_checkpoint_pickle_is_explained_whole(tmp_path):
    from toolkit.parallel import checkpoint

    class Runs:
        def __reduce__(self):
            return (os.system, ("true",))

    path = str(tmp_path / "foreign.pt")
    torch.save({"x": Runs()}, path)
    _, why = checkpoint._read(path)
    assert "holds Python objects other than tensors" in why and "GLOBAL posix.system" in why
    assert "torch.load(path, weights_only=False)" in why and "load_full_checkpoint" in why
    (tmp_path / "cut.pt").write_bytes(open(path, "rb").read()[:40])
    assert "damaged (cut short?" in checkpoint._read(str(tmp_path / "cut.pt"))[1]


def _loads_a_cut_shard(folder):
    from functools import partial

    import torch.distributed as dist

    from toolkit.parallel import checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, opt = toolkit.parallel.wrap(
        model, "fsdp", wrap_policy=torch.nn.Linear, optimizer=partial(torch.optim.AdamW, lr=1e-3)
    )
    path = checkpoint.save_sharded(model, opt, folder)
    if dist.get_rank() == 1:
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    checkpoint.load_sharded(model, opt, folder)


def test_a_rank_that_cannot_load_its_checkpoint_is_named_with_its_own_error(tmp_path, no_leftover_ranks):
    with pytest.raises(RankError) as info:
        toolkit.launch(_loads_a_cut_shard, 3, args=(str(tmp_path),), timeout_s=30, quiet=True)
    message = str(info.value)
    assert info.value.rank == 1 and message.startswith("rank 1 raised ValueError: could not read the checkpoint")
    assert "shard-00001-of-00003.pt': the file is damaged" in message
    assert "  - rank 0: rank 1 could not load the checkpoint" in message
    assert "  - rank 2: rank 1 could not load the checkpoint" in message


def _loads_a_swapped_shard(folder):
    import shutil
    from functools import partial

    import torch.distributed as dist

    from toolkit.parallel import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, opt = toolkit.parallel.wrap(
        model, "fsdp", wrap_policy=torch.nn.Linear, optimizer=partial(torch.optim.AdamW, lr=1e-3)
    )
    path = checkpoint.save_sharded(model, opt, folder)
    comm.barrier()
    if dist.get_rank() == 2:  # rank 0's file copied over rank 2's: same shapes, same layout, wrong slices
        shutil.copyfile(path.replace("shard-00002", "shard-00000"), path)
    comm.barrier()
    before = [u.master.clone() for u in model.engine.units]
    try:
        checkpoint.load_sharded(model, opt, folder)
    finally:
        unchanged = all(torch.equal(a, u.master) for a, u in zip(before, model.engine.units))
        open(os.path.join(folder, f"unchanged-{dist.get_rank()}"), "w").write(str(unchanged))


def test_a_shard_file_of_another_rank_is_refused_naming_the_file_and_both_ranks(tmp_path, no_leftover_ranks):
    """Every shard has the same shapes, so a file copied from another rank loads without a shape error: only
    the rank it records can tell. Before this check rank 2 silently held rank 0's slices."""
    with pytest.raises(RankError) as info:
        toolkit.launch(_loads_a_swapped_shard, 3, args=(str(tmp_path),), timeout_s=30, quiet=True)
    message = str(info.value)
    assert info.value.rank == 2, message
    assert message.startswith("rank 2 raised ValueError: ") and "shard-00002-of-00003.pt" in message, message
    assert "was written by rank 0 (slice 0 of its sharding group), not rank 2 (slice 2)" in message, message
    assert "  - rank 0: rank 2 could not load the checkpoint" in message
    assert all((tmp_path / f"unchanged-{r}").read_text() == "True" for r in range(3))


class _GoesNanOnRank1AtStep2(torch.nn.Module):
    """A model whose loss is NaN on rank 1 at step 2 only: afterwards the all-reduced gradients carry it."""

    def __init__(self, config):
        super().__init__()
        self.inner, self.calls = toolkit.train.build_model(config), 0

    def forward(self, x, y):
        import torch.distributed as dist

        loss = self.inner(x, y)
        self.calls += 1
        return loss * float("nan") if dist.get_rank() == 1 and self.calls == 3 else loss


def test_a_nan_loss_names_the_rank_and_step_where_it_first_appeared(no_leftover_ranks):
    """Every rank's loss is NaN from step 3 on; before, the run returned NaN losses and named nobody."""
    from toolkit.train import TrainConfig, launch_train

    config = TrainConfig(
        strategy="ddp",
        steps=5,
        global_batch_size=6,
        progress=False,
        sample_memory=False,
        model=dict(n_layer=1, d_model=16, n_head=2),
    )
    with pytest.raises(RankError) as info:
        launch_train(config, 3, model_fn=_GoesNanOnRank1AtStep2, timeout_s=60, quiet=True)
    message = str(info.value)
    assert info.value.rank == 1, message
    assert message.startswith(
        "rank 1 raised NonFiniteLoss: the loss went non-finite first on rank 1 at step 2 "
        "(of steps 0-4), and the run ended non-finite; this rank's loss there was nan."
    ), message
    for other in (0, 2):
        assert (
            f"  - rank {other}: the loss went non-finite first on rank 1 at step 2" in message
            and "went non-finite at step 3 only because the gradient all-reduce spread it here" in message
        ), message
