"""Expert parallelism under context parallelism, on the one mesh: an MoE GPT trains at cp 2 as one process trains it.

- The layout (Megatron-core's carving, `toolkit/parallel/expert_layout.py`): the experts are split over ep ranks
  carved from a stage's dp x cp x tp (runs of ep, innermost dimension first) and copied over the rest (the
  expert-data-parallel ranks); every cp rank routes its own tokens; dense gradients are averaged over dp x cp,
  an expert's arrive summed through the all-to-all's backward, its copies' sums are added up, and the total is
  divided by dp x cp. Any other split is refused before a step, in the words of the keywords given.
- The load-balancing loss counts each expert's first choices over the whole sequence (Megatron's
  sequence_partition_group): each rank's loss is E·Σ f·P_c, their mean the sequence's. Without that the final
  parameters differ from one process's by ~2e-4 (GShard's loss is a product of two means, not a mean).
- Parity at world 4 (losses and final parameters, fp32) against one process accumulating what each rank's
  routing balances as one micro-batch (a dp replica's rows; under tp a tp share, `tensor/moe.py`): dp 2 x cp 2
  with ep 4 (one copy of each expert) and ep 2 (experts over each cp pair, copied over dp: without the copies'
  all-reduce the parameters are off by 0.03), and cp 2 x tp 2 with ep 2, clipped (copies over cp: a norm that
  counts both copies is off by 1e-3 in the loss), and pp 2 x cp 2 with ep 1 (every expert on each rank, copied
  over cp; the pipeline's micro-batches, clipped). Dropless: capacity is per rank's tokens (GShard's groups,
  Megatron's too), so a capacity that drops would drop other tokens at s/cp than at s.
- The simulator runs the same layout on the fake group; its model states equal the real rank's.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import toolkit
from toolkit.moe.losses import gshard_aux_loss, switch_aux_loss
from toolkit.parallel import mesh
from toolkit.train import TrainConfig, moe_model_fn, train

LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-5  # fp32: the split only reorders sums (tests/test_pipeline.py derives these)
SMALL = dict(n_layer=2, d_model=16, n_head=2)
BASE = dict(steps=3, seq_len=16, optimizer="sgd", lr=0.5, progress=False, model=SMALL)
MOE = dict(num_experts=4, top_k=2, moe_options=dict(dropless=True, z_loss_weight=1e-3))
CASES = {  # name: (TrainConfig fields at world 4, the reference's accumulation: what one process's micro-batch is)
    "dp 2 x cp 2, ep 4: one copy of each expert": (
        dict(strategy="ddp", global_batch_size=4, options={"cp": 2}),
        2,
    ),
    "dp 2 x cp 2, ep 2: experts over cp, copied over dp": (
        dict(strategy="ddp", global_batch_size=4, options={"cp": 2, "ep": 2}),
        2,
    ),
    "cp 2 x tp 2, ep 2: experts over tp, copied over cp, clipped": (
        dict(strategy="ddp", global_batch_size=2, clip=0.05, options={"cp": 2, "tp": 2, "ep": 2}),
        2,
    ),
    "pp 2 x cp 2, ep 1: all experts on each rank, copied over cp, clipped": (
        dict(
            strategy="ddp",
            global_batch_size=2,
            clip=0.05,
            model=dict(SMALL, n_layer=4),
            options={"cp": 2, "pp": 2, "microbatches": 2, "ep": 1},
        ),
        2,  # the pipeline's micro-batches
    ),
}
BAD = {  # name: (how the MoE GPT's experts are split, wrap's keywords)
    "experts over dp, not carved": (lambda: mesh.own_group([[0, 2], [1, 3]]), dict(cp=2)),
    "ep does not divide dp x cp": (lambda: None, dict(cp=2, ep=3)),
    "ep says 2, the model the world": (lambda: None, dict(cp=2, ep=2)),
    "copies under local": (lambda: mesh.expert_group(2, tp=2), dict(tp=2)),
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
    for name, (group, keywords) in BAD.items():
        model = toolkit.models.moe_gpt(4, 2, group=group(), seq_len=16, **SMALL)
        strategy = "local" if name == "copies under local" else "ddp"
        try:
            toolkit.parallel.wrap(model, strategy, **keywords)
            found[name] = None
        except ValueError as exc:
            found[name] = str(exc)
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


EXPECTED = {  # name: what every rank's message says (rank 0's groups)
    "experts over dp, not carved": [
        "cp=2 (dp 2 x pp 1 x cp 2 x tp 1)",
        "over ranks [0, 2]",
        "expert-parallel group of 2 is [0, 1]",
        "[[0, 1], [2, 3]]",
        "group=toolkit.parallel.mesh.expert_group(2, cp=2)",
        "moe_model_fn",
    ],
    "ep does not divide dp x cp": ["ep=3", "dp x cp x tp = 4 ranks", "one of [1, 2, 4]"],
    "ep says 2, the model the world": ["and ep=2", "over ranks [0, 1, 2, 3]", "expert_group(2, cp=2)"],
    "copies under local": ["ep=2", "strategy 'local' averages nothing", "'dp' or 'ddp'"],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_experts_split_other_than_megatrons_carving_are_refused_on_every_rank(name, no_leftover_ranks):
    for rank, found in enumerate(launched()):
        message = found[name]
        assert message is not None, f"{name}: no error on rank {rank}"
        for part in EXPECTED[name] if rank == 0 else EXPECTED[name][:1]:
            assert part in message, (name, rank, part, message)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES)[:2])
def test_the_simulator_runs_the_same_layout(name, no_leftover_ranks):
    fields, _ = CASES[name]
    options = fields["options"]

    def model():
        group = mesh.expert_group(options["ep"], cp=options["cp"]) if "ep" in options else None
        return toolkit.models.moe_gpt(4, 2, group=group, seq_len=16, **SMALL, moe_options=MOE["moe_options"])

    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    sim = toolkit.sim.simulate(model, "ddp", 4, rank=3, batch_per_rank=1, optimizer=sgd, progress=False, **options)
    measured = launched()[3][name]["states"]
    assert {k: sim.memory[k] for k in measured} == measured


# --- world 8 (make test-large-world) --------------------------------------------------------------------------------
AT_8 = dict(  # dp 2 x pp 2 x cp 2: each stage's 4 ranks, experts over each cp pair, copied over dp
    strategy="ddp",
    global_batch_size=4,
    clip=0.05,
    model=dict(SMALL, n_layer=4),
    options={"cp": 2, "pp": 2, "microbatches": 2, "ep": 2},
)


def at_8() -> tuple:
    torch.manual_seed(0)
    run, state = train(TrainConfig(**{**BASE, **AT_8}), model_fn=moe_model_fn(**MOE), return_state=True)
    return [m["value"] for m in run.metrics if m["name"] == "loss"], state


@pytest.mark.large_world
@pytest.mark.timeout(900)
def test_dp_x_pp_x_cp_with_experts_copied_over_dp_trains_as_one_process(no_leftover_ranks):
    losses, state = toolkit.launch(at_8, 8, timeout_s=800, quiet=True)[0]
    torch.manual_seed(0)  # one process: each replica's micro-batch (a row) balances its own tokens
    config = TrainConfig(**{**BASE, **AT_8, "strategy": "local", "options": {}, "accumulation": 4})
    run, want = train(config, model_fn=moe_model_fn(**MOE), return_state=True)
    expected = [m["value"] for m in run.metrics if m["name"] == "loss"]
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= LOSS_ATOL, (losses, expected)
    assert max((state[k] - want[k]).abs().max().item() for k in want) <= PARAM_ATOL
