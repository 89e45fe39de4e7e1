"""The training loop: it learns, accumulation and data parallelism change nothing but roundoff, and its
trace holds exactly the strategy's communication.

Parity tests use SGD: its update is linear in the gradient, so summing micro-batch gradients in another
order changes the parameters by roundoff only (~1e-8). Adam divides by sqrt(v), which blows the same
roundoff up wherever a gradient is near zero (~1e-5 after a few steps), so its parity is looser.
"""

import contextlib
import importlib.util
import math

import pytest
import torch.nn as nn

import toolkit
from toolkit import comm, parallel
from toolkit.models import tiny_gpt
from toolkit.run import Run
from toolkit.trace.analysis import bytes_per_step
from toolkit.train import TrainConfig, launch_train, train

SGD = dict(optimizer="sgd", lr=0.1, progress=False, sample_memory=False)
STEPS = 3


@pytest.fixture(scope="module")
def reference():
    """ "local", one batch per step, SGD: the (run, final parameters) every parity test compares with."""
    return train(TrainConfig(steps=STEPS, **SGD), return_state=True)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def losses(run, rank=None):
    return [v for _, v in run.metric("loss", rank)]


# --- one process ----------------------------------------------------------------------------------
def test_local_loss_falls():
    run = train(TrainConfig(steps=30, progress=False, sample_memory=False))
    curve = losses(run)
    assert len(curve) == 30
    assert curve[0] == pytest.approx(math.log(64), abs=0.15)  # an untrained model knows nothing
    assert sum(curve[-5:]) / 5 < curve[0] - 0.6


@pytest.mark.parametrize("accumulation", [2, 4])
def test_accumulation_equals_one_big_batch(accumulation, reference):
    ref_run, ref = reference
    run, state = train(TrainConfig(steps=STEPS, accumulation=accumulation, **SGD), return_state=True)
    assert max_diff(state, ref) < 1e-6
    assert losses(run) == pytest.approx(losses(ref_run), abs=1e-6)


def test_accumulation_with_adamw_matches_to_roundoff():
    _, ref = train(TrainConfig(steps=3, progress=False, sample_memory=False), return_state=True)
    _, state = train(TrainConfig(steps=3, accumulation=2, progress=False, sample_memory=False), return_state=True)
    assert max_diff(state, ref) < 1e-5


def test_clipping_bounds_the_update():
    before = train(TrainConfig(steps=1, **dict(SGD, lr=1e-9)), return_state=True)[1]  # ~ the initial weights
    run, after = train(TrainConfig(steps=1, clip=0.01, **dict(SGD, lr=1.0)), return_state=True)
    ((_, norm),) = run.metric("grad_norm")
    assert norm > 0.01  # the gradient was longer than the limit...
    update = math.sqrt(sum(float((after[k] - before[k]).double().pow(2).sum()) for k in after))
    assert update == pytest.approx(0.01, rel=1e-4)  # ...so the SGD step (lr 1) has length 0.01


def test_trace_phases_and_memory_samples():
    config = TrainConfig(steps=2, global_batch_size=4, progress=False)
    run = train(config)
    assert TrainConfig.of(run.config) == config  # the Run says how it was made
    names = [(e["name"], e["phase"]) for e in run.events]
    assert names == [("forward", "forward"), ("backward", "backward"), ("optimizer", "optimizer")] * 2
    assert run.comm_events() == []  # one process: nothing to say to anyone
    assert [m["name"] for m in run.metrics].count("step_time") == 2

    model = tiny_gpt()
    n, tensors = model.num_params(), len(list(model.parameters()))
    step1 = [s for s in run.samples if s["step"] == 1]
    assert [s["phase"] for s in step1] == ["forward", "forward", "backward", "optimizer"]
    before_fwd, after_fwd, after_bwd, after_opt = step1
    assert all(s["params"] == 4 * n for s in step1)
    assert before_fwd["activations"] == 0 < after_fwd["activations"]
    assert after_bwd["activations"] == 0  # backward released what the forward saved
    # after backward in step 1: fp32 params + grads + AdamW's two moments and a step scalar per tensor
    assert (after_bwd["grads"], after_bwd["optimizer"]) == (4 * n, 8 * n + 4 * tensors)
    assert after_opt["grads"] == 0  # zero_grad sets them to None


def test_config_errors_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        TrainConfig(strategy="zero4")
    with pytest.raises(ValueError, match="micro-batches"):
        TrainConfig(global_batch_size=6, accumulation=4)
    with pytest.raises(ValueError, match="TrainConfig.vocab_size"):
        TrainConfig(model={"vocab_size": 10})
    with pytest.raises(ValueError, match="clip"):
        TrainConfig(clip=-1.0)
    with pytest.raises(ValueError, match="multiple of 4"):
        TrainConfig(global_batch_size=6, accumulation=2).check_world(2)
    with pytest.raises(ValueError, match="launch_train"):
        train(TrainConfig(strategy="ddp", progress=False))
    with pytest.raises(ValueError, match="multiple of 4"):
        launch_train(TrainConfig(global_batch_size=6, accumulation=2), world_size=2)  # before any launch


# --- two ranks ------------------------------------------------------------------------------------
class AllReduceEachGradient(nn.Module):
    """The smallest data parallelism, written here so the loop is tested on its own: each gradient is
    averaged through the collectives door the moment backward has accumulated it (unless no_sync)."""

    def __init__(self, module):
        super().__init__()
        self.module, self.sync = module, True
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, p):
        if self.sync:
            comm.all_reduce(p.grad, op="avg")

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def forward(self, x, y):
        return self.module(x, y)

    def full_state_dict(self):
        return {k: p.detach().clone() for k, p in self.module.named_parameters()}


def wrap_allreduce(model, optimizer, **options):
    return AllReduceEachGradient(model), optimizer(model.parameters())


def register():
    parallel.STRATEGIES["test-allreduce"] = (__name__, "wrap_allreduce")


def rank_body(config):
    register()  # a fresh process: the test's strategy must be registered there too
    return train(config, return_state=True)


@pytest.mark.timeout(120)
def test_two_ranks_match_local_and_record_only_the_strategys_traffic(monkeypatch, reference):
    monkeypatch.setitem(parallel.STRATEGIES, "test-allreduce", (__name__, "wrap_allreduce"))
    (ref_run, ref), steps = reference, STEPS
    config = TrainConfig(strategy="test-allreduce", steps=steps, accumulation=2, **SGD)
    results = toolkit.launch(rank_body, 2, args=(config,), timeout_s=60)
    run = Run.merge(r for r, _ in results)
    assert max_diff(results[0][1], ref) < 1e-6 and max_diff(results[1][1], ref) < 1e-6
    # the global loss is every rank's, and it is the one-process loss; the ranks' own losses differ
    assert losses(run, 0) == losses(run, 1) == pytest.approx(losses(ref_run), abs=1e-6)
    assert [v for _, v in run.metric("local_loss", 0)] != [v for _, v in run.metric("local_loss", 1)]
    # per step exactly one average of every gradient (no_sync skipped the first micro-batch's), in
    # backward; ring all-reduce on 2 ranks sends 2(N-1)/N = 1x each gradient's bytes. The loss
    # bookkeeping added nothing.
    model = tiny_gpt()
    n, tensors = model.num_params(), len(list(model.parameters()))
    for rank in (0, 1):
        assert bytes_per_step(run, rank) == [{"backward": 4 * n, "total": 4 * n}] * steps
        assert len(run.comm_events(rank)) == steps * tensors


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    importlib.util.find_spec("toolkit.parallel.ddp") is None,
    reason="toolkit/parallel/ddp.py is not written yet: no real data-parallel strategy to launch",
)
def test_launch_train_ddp_matches_local(reference):
    (ref_run, ref), steps = reference, STEPS
    run, state = launch_train(
        TrainConfig(strategy="ddp", steps=steps, accumulation=2, **SGD), 2, return_state=True, timeout_s=60
    )
    assert run.meta["ranks"] == [0, 1]
    assert max_diff(state, ref) < 1e-6
    assert losses(run) == pytest.approx(losses(ref_run), abs=1e-6)
    per_step = bytes_per_step(run, 0)
    assert len(per_step) == steps
    # the same traffic every step, one reduction per step; step 1 also carries DDP's bucket rebuild, one
    # broadcast of rank 0's gradient-ready order (an int64 per parameter tensor)
    order = 8 * len(list(tiny_gpt().parameters()))
    assert per_step[1] == {**per_step[0], "forward": order, "total": per_step[0]["total"] + order}
    assert [s for i, s in enumerate(per_step) if i != 1] == [per_step[0]] * (steps - 1)
    # a ring all-reduce on 2 ranks sends 2(N-1)/N = 1x the message: every fp32 gradient once
    assert per_step[0]["total"] == 4 * tiny_gpt().num_params()
