"""Expert parallelism under context parallelism, on the one mesh: an MoE GPT trains at cp 2 as one process trains it.

- The layout (Megatron-core's): the experts are split over every rank of dp x cp (x tp), one copy of each; every cp
  rank routes its own tokens; the dense gradients are averaged over dp x cp, the experts' arrive whole through the
  all-to-all's backward. A layer over fewer ranks is refused before any step, in the words of cp=.
- The load-balancing loss counts each expert's first choices over the whole sequence (Megatron's
  sequence_partition_group): each rank's loss is E·Σ f·P_c, their mean the sequence's. Without that the final
  parameters differ from one process's by ~2e-4 (GShard's loss is a product of two means, not a mean).
- Parity at world 4 (losses and final parameters, fp32): dp 2 x cp 2 with ep 4 against one process accumulating the
  two replicas' rows (each replica balances its own rows, as each of one process's micro-batches does), and
  cp 2 x tp 2 with ep 4 against one process accumulating the two tp shares (tensor/moe.py's rule). Dropless:
  capacity is per rank's tokens (GShard's groups, Megatron's too), so a capacity that drops would drop other
  tokens at s/cp than at s.
- The simulator runs the same layout on the fake group, its model states equal the real rank's.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from cp_rank_checks import groups_of

import toolkit
from toolkit.moe.losses import gshard_aux_loss, switch_aux_loss
from toolkit.train import TrainConfig, moe_model_fn, train

LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-5  # fp32: the split only reorders sums (tests/test_pipeline.py derives these)
SMALL = dict(n_layer=2, d_model=16, n_head=2)
BASE = dict(steps=3, seq_len=16, optimizer="sgd", lr=0.5, progress=False, model=SMALL)
MOE = dict(num_experts=4, top_k=2, moe_options=dict(dropless=True, z_loss_weight=1e-3))
CASES = {  # name: (TrainConfig fields at world 4, the reference's accumulation: what one process's micro-batch is)
    "dp 2 x cp 2, ep 4": (dict(strategy="ddp", global_batch_size=4, options={"cp": 2}), 2),
    "cp 2 x tp 2, ep 4": (dict(strategy="ddp", global_batch_size=2, options={"cp": 2, "tp": 2}), 2),
}


# --- one process: the rule --------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", [gshard_aux_loss, switch_aux_loss])
def test_the_ranks_balancing_losses_average_to_the_sequences_when_counts_are_the_sequences(loss):
    torch.manual_seed(0)
    probs = torch.randn(32, 4, dtype=torch.float64).softmax(-1)
    top1 = probs.argmax(-1)
    halves = [(probs[:16], top1[:16]), (probs[16:], top1[16:])]
    whole = sum(torch.bincount(t, minlength=4) for _, t in halves)  # what counts_over_cp sums over the cp ranks
    mean = sum(loss(p, t, counts=whole) for p, t in halves) / 2
    assert mean.item() == pytest.approx(loss(probs, top1).item(), rel=1e-12)
    own = sum(loss(p, t) for p, t in halves) / 2  # each half balancing its own tokens: another number
    assert own.item() != pytest.approx(loss(probs, top1).item(), rel=1e-3)


# --- real ranks: one launch ---------------------------------------------------------------------------------------
def on_ranks() -> dict:
    found = {}
    for name, (fields, _) in CASES.items():
        torch.manual_seed(0)
        run, state = train(TrainConfig(**{**BASE, **fields}), model_fn=moe_model_fn(**MOE), return_state=True)
        last = [s for s in run.samples if s["step"] == BASE["steps"] - 1 and s["phase"] == "backward"]
        found[name] = {
            "losses": [m["value"] for m in run.metrics if m["name"] == "loss"],
            "state": state if dist.get_rank() == 0 else None,
            "states": {k: last[0][k] for k in ("params", "grads", "optimizer")} if last else None,
        }
    cp_group = groups_of(2)  # ranks [0, 1] and [2, 3]: the cp groups of dp 2 x cp 2 in Megatron's order
    try:
        model = toolkit.models.moe_gpt(4, 2, group=cp_group, seq_len=16, **SMALL)
        toolkit.parallel.wrap(model, "ddp", cp=2)
        found["experts over cp only"] = None
    except ValueError as exc:
        found["experts over cp only"] = str(exc)
    return found


@functools.cache
def launched():
    return toolkit.launch(on_ranks, 4, timeout_s=240, quiet=True)


@functools.cache
def reference(name):
    fields, accumulation = CASES[name]
    torch.manual_seed(0)
    config = TrainConfig(**{**BASE, **fields, "strategy": "local", "options": {}, "accumulation": accumulation})
    run, state = train(config, model_fn=moe_model_fn(**MOE), return_state=True)
    return [m["value"] for m in run.metrics if m["name"] == "loss"], state


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_an_moe_gpt_under_cp_trains_as_one_process(name, no_leftover_ranks):
    losses, state = reference(name)
    mine = launched()[0][name]
    assert max(abs(a - b) for a, b in zip(mine["losses"], losses)) <= LOSS_ATOL, (name, mine["losses"], losses)
    assert set(mine["state"]) == set(state) and any(".experts.3." in k for k in state), name
    worst = max((mine["state"][k] - state[k]).abs().max().item() for k in state)
    assert worst <= PARAM_ATOL, (name, worst)


@pytest.mark.timeout(300)
def test_experts_over_fewer_ranks_than_dp_x_cp_are_refused_on_every_rank(no_leftover_ranks):
    for rank, found in enumerate(launched()):
        message = found["experts over cp only"]
        assert message is not None, f"rank {rank}: no error"
        mine = [0, 1] if rank < 2 else [2, 3]
        for part in ("cp=2", f"ranks {mine}", "dp x cp x tp = [0, 1, 2, 3]", "group=None", "moe_model_fn"):
            assert part in message, (rank, part, message)


@pytest.mark.timeout(300)
def test_the_simulator_runs_the_same_layout(no_leftover_ranks):
    name = "dp 2 x cp 2, ep 4"
    fields, _ = CASES[name]
    sim = toolkit.sim.simulate(
        lambda: toolkit.models.moe_gpt(4, 2, seq_len=16, **SMALL, moe_options=MOE["moe_options"]),
        "ddp",
        4,
        rank=3,
        batch_per_rank=1,
        optimizer=functools.partial(torch.optim.SGD, lr=0.5),
        progress=False,
        **fields["options"],
    )
    measured = launched()[3][name]["states"]
    assert {k: sim.memory[k] for k in measured} == measured
