"""Four dimensions at world 8, in both rank orders: every layout trains what one process trains.

- dp 2 x pp 2 x tp 2 in Megatron's order (pp outermost) and with dp outermost: the same losses and parameters
  as one process (issue 30: the order is an option; nothing that runs on the mesh may depend on it);
- dp 2 x pp 2 x cp 2 (ring attention inside a pipeline, ddp over dp x cp) and fsdp over dp 2 x cp 2 with tp 2;
- a checkpoint saved at dp 2 x pp 2 x tp 2 with dp outermost loads, bit for bit, at the same sizes in Megatron's
  order and at dp 2 x cp 2 x tp 2.

Eight processes on two cores: a minute or more, so `make test-large-world`, not `make test`.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import toolkit
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel import mesh
from toolkit.train import TrainConfig, train

pytestmark = pytest.mark.large_world

LOSS_ATOL, PARAM_ATOL = 1e-4, 1e-5  # derived in tests/test_pipeline.py: a split changes only the order of sums
MODEL = dict(n_layer=4, d_model=64, n_head=4)
BASE = dict(steps=2, global_batch_size=4, optimizer="sgd", lr=0.1, progress=False, sample_memory=False, model=MODEL)
CASES = [
    (
        "zero1 dp2 x pp2 x tp2, Megatron's order",
        dict(strategy="zero1", clip=0.05, options={"pp": 2, "tp": 2, "microbatches": 2}),
    ),
    (
        "zero1 dp2 x pp2 x tp2, dp outermost",
        dict(strategy="zero1", clip=0.05, options={"pp": 2, "tp": 2, "microbatches": 2, "order": mesh.DP_OUTERMOST}),
    ),
    ("ddp dp2 x pp2 x cp2", dict(strategy="ddp", options={"pp": 2, "cp": 2, "microbatches": 2})),
    ("fsdp dp2 x cp2 x tp2", dict(strategy="fsdp", clip=0.05, options={"cp": 2, "tp": 2})),
]
ADAM = dict(lr=1e-2)


def checkpoints(directory: str) -> dict:
    """Train at dp 2 x pp 2 x tp 2, dp outermost, and save; load in Megatron's order and at dp 2 x cp 2 x tp 2."""
    from toolkit.parallel.checkpoint import load_full, save_full

    def adam(params):
        return torch.optim.AdamW(params, **ADAM)

    first = dict(pp=2, tp=2, microbatches=2, order=mesh.DP_OUTERMOST)
    torch.manual_seed(0)
    model, opt = toolkit.parallel.wrap(tiny_gpt(**MODEL), "zero1", optimizer=adam, **first)
    dp_rank = mesh.layout(8, pp=2, tp=2, order=mesh.DP_OUTERMOST).coordinate(dist.get_rank()).dp
    for step in range(2):
        model.forward_backward(*SyntheticCorpus().batch(step, 4, rank=dp_rank, world_size=2))
        opt.step()
        opt.zero_grad()
    path = os.path.join(directory, "dp-outermost.pt")
    save_full(model, opt, path)
    saved = toolkit.parallel.full_state_dict(model)
    found = {}
    for name, strategy, options in (
        ("Megatron's order", "zero1", dict(pp=2, tp=2, microbatches=2)),
        ("dp2 x cp2 x tp2", "zero2", dict(cp=2, tp=2)),
    ):
        torch.manual_seed(1)  # other initial values: only the checkpoint can make them equal
        other, other_opt = toolkit.parallel.wrap(tiny_gpt(**MODEL), strategy, optimizer=adam, **options)
        load_full(other, other_opt, path)
        state = toolkit.parallel.full_state_dict(other)
        found[name] = set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)
    return found


def on_ranks(directory: str):
    found = {}
    for name, fields in CASES:
        torch.manual_seed(0)
        run, state = train(TrainConfig(**{**BASE, **fields}), return_state=True)
        found[name] = ([m["value"] for m in run.metrics if m["name"] == "loss"], state)
    found["checkpoints"] = checkpoints(directory)
    return found if dist.get_rank() == 0 else None


@pytest.mark.timeout(900)
def test_four_dimensions_in_both_orders_train_as_one_process(tmp_path, no_leftover_ranks):
    got = toolkit.launch(on_ranks, 8, args=(str(tmp_path),), timeout_s=800, quiet=True)[0]
    for name, fields in CASES:
        torch.manual_seed(0)
        run, state = train(TrainConfig(**{**BASE, "clip": fields.get("clip")}), return_state=True)
        losses = [m["value"] for m in run.metrics if m["name"] == "loss"]
        mine, final = got[name]
        assert max(abs(a - b) for a, b in zip(mine, losses)) <= LOSS_ATOL, (name, mine, losses)
        assert set(final) == set(state), name
        worst = max((final[k] - state[k]).abs().max().item() for k in state)
        assert worst <= PARAM_ATOL, (name, worst)
    assert got["checkpoints"] == {"Megatron's order": True, "dp2 x cp2 x tp2": True}
