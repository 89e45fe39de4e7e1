"""Pipeline parallelism trains exactly what one process trains: every schedule, composed with dp and tp.

Every layout runs the toolkit's own training loop (`toolkit.train.train`, which calls `forward_backward` under
pp) inside one launch per world size; the one-process references run here, in the test's process. The MoE
GPT's reference accumulates the same micro-batches (its gate's capacity and load-balancing loss are per
micro-batch), the dense ones take the whole batch at once.

Tolerances, fp32 (unit roundoff u = 2^-24 = 6e-8), as tests/test_tensor_parallel.py derives them. A pipeline
changes only the order of sums: the batch's mean loss is the mean of m micro-batches' means, and each
gradient element the sum of m micro-batches' sums over the b·s = 256 tokens of a step.
- Loss (about 4.2): a mean of 256 per-token losses of about 4.2 taken in another order moves by at most
  256 · u · 4.2 = 6.4e-5 -> LOSS_ATOL = 1e-4.
- Parameters: |Δg| <= 256 · u = 1.5e-5 (the gradient's elements add up to less than 1 here); two SGD steps at
  lr 0.1 with momentum 0.9 move a parameter by at most 0.1 · (1 + 1.9) · Δg = 4.4e-6 -> PARAM_ATOL = 1e-5. A
  micro-batch left out, or a tied gradient not summed, moves a parameter by lr·|g|, 1e-3 and more.
- Mixed precision (bf16 compute, fp32 masters), against "local" with the same recipe: MP_LOSS_ATOL = 3/32 and
  MP_PARAM_ATOL = 5e-4, derived in tests/test_tensor_parallel.py (bf16 rounding of the loss and gradients).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel import _same  # nested checkpoints compared value by value

import toolkit
from toolkit.memory.ledger import ActivationMeter
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel.pipeline import bubble, lowering, schedules
from toolkit.train import TrainConfig, moe_model_fn, train

LOSS_ATOL, PARAM_ATOL = 1e-4, 1e-5
MP_LOSS_ATOL, MP_PARAM_ATOL = 3 / 32, 5e-4
BASE = dict(steps=2, global_batch_size=8, optimizer="sgd", lr=0.1, progress=False, sample_memory=False)
FOUR = {"n_layer": 4}
MOE = dict(num_experts=4, top_k=2, capacity_factor=2.0)

# (name, TrainConfig fields, MoE?, the reference's fields): world 2 = pp 2; world 4 = dp 2 x pp 2 or tp 2 x pp 2
CASES = {
    2: [
        ("gpipe", dict(model=FOUR, options={"pp": 2, "microbatches": 4, "schedule": "gpipe"}), False, dict(model=FOUR)),
        ("1f1b", dict(model=FOUR, options={"pp": 2, "microbatches": 4}), False, dict(model=FOUR)),
        (
            "interleaved",
            dict(model=FOUR, options={"pp": 2, "microbatches": 4, "schedule": "interleaved", "virtual_stages": 2}),
            False,
            dict(model=FOUR),
        ),
        ("zb-h1", dict(model=FOUR, options={"pp": 2, "microbatches": 4, "schedule": "zb-h1"}), False, dict(model=FOUR)),
        ("moe pp", dict(options={"pp": 2, "microbatches": 2}), True, dict(accumulation=2)),
        (
            "pp bf16",
            dict(model=FOUR, options={"pp": 2, "microbatches": 2, "mixed_precision": True}),
            False,
            dict(model=FOUR, options={"mixed_precision": True}),
        ),
    ],
    4: [
        (
            "ddp x pp",
            dict(strategy="ddp", clip=0.05, model=FOUR, options={"pp": 2, "microbatches": 2}),
            False,
            dict(model=FOUR, clip=0.05),
        ),
        (
            "fsdp x pp, 1f1b",
            dict(strategy="fsdp", model=FOUR, options={"pp": 2, "microbatches": 2}),
            False,
            dict(model=FOUR),
        ),
        (
            "zero3 x pp, gpipe",
            dict(strategy="zero3", model=FOUR, options={"pp": 2, "microbatches": 2, "schedule": "gpipe"}),
            False,
            dict(model=FOUR),
        ),
        (
            "zero1 x pp, zb-h1",
            dict(strategy="zero1", model=FOUR, options={"pp": 2, "microbatches": 2, "schedule": "zb-h1"}),
            False,
            dict(model=FOUR),
        ),
        (
            "zero3 x pp, zb-h1",  # W after B: each module's parameters stay gathered until its gradients are complete
            dict(strategy="zero3", model=FOUR, options={"pp": 2, "microbatches": 2, "schedule": "zb-h1"}),
            False,
            dict(model=FOUR),
        ),
        (
            "tp+sp x pp",
            dict(clip=0.05, model=FOUR, options={"pp": 2, "tp": 2, "sequence_parallel": True, "microbatches": 4}),
            False,
            dict(model=FOUR, clip=0.05),
        ),
    ],
    8: [
        (
            "zero1 x pp x tp",
            dict(strategy="zero1", clip=0.05, model=FOUR, options={"pp": 2, "tp": 2, "microbatches": 2}),
            False,
            dict(model=FOUR, clip=0.05),
        )
    ],
}


def losses_of(run) -> list:
    return [m["value"] for m in run.metrics if m["name"] == "loss"]


def reference(fields, moe):
    return train(
        TrainConfig(**{**BASE, "strategy": "local", **fields}),
        model_fn=moe_model_fn(**MOE) if moe else None,
        return_state=True,
    )


def layouts(world, directory):
    found = {}
    for name, fields, moe, _ in CASES[world]:
        torch.manual_seed(0)
        run, state = train(
            TrainConfig(**{**BASE, **fields}), model_fn=moe_model_fn(**MOE) if moe else None, return_state=True
        )
        found[name] = (losses_of(run), state)
        if name == "zb-h1":  # both ranks' records, for the figure
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, run)
            found["zb-h1 run"] = toolkit.Run.merge(everyone)
        if name == "ddp x pp":
            found["ddp bytes"] = dp_bytes(run)
    if world == 2:
        found["memory"] = activations()
        found["p2p"] = p2p_bytes()
    if world == 4:
        found["checkpoints"] = checkpoints_across_layouts(directory)
    return found if dist.get_rank() == 0 else None


@functools.cache
def launched(world: int, directory: str):
    return toolkit.launch(layouts, world, args=(world, directory), timeout_s=420, quiet=True)[0]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pp-checkpoints"))


def compare(name, got, expected):
    (losses, state), (ref_losses, ref_state) = got, expected
    loss_atol, param_atol = (MP_LOSS_ATOL, MP_PARAM_ATOL) if "bf16" in name else (LOSS_ATOL, PARAM_ATOL)
    assert set(state) == set(ref_state), (name, set(state) ^ set(ref_state))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= loss_atol, (name, losses, ref_losses)
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst <= param_atol, (name, worst)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_pipeline_layouts_train_as_one_process(world, directory, no_leftover_ranks):
    got = launched(world, directory)
    for name, _, moe, ref_fields in CASES[world]:
        run, state = reference(ref_fields, moe)
        compare(name, got[name], (losses_of(run), state))


# --- what moves, what is kept ---------------------------------------------------------------------------------
def dp_bytes(run) -> tuple:
    """(bytes rank 0 sent in the dp group's all-reduces per step, its stage's gradient bytes, dp size)."""
    group = toolkit.parallel.mesh.layout(4, pp=2).group_of(0, "dp")  # world 4, dp 2 x pp 2: stage 0's replicas
    sent = sum(
        e["args"]["bytes_sent"]
        for e in run.comm_events(0, "all_reduce")
        if e["args"]["group"] == group and e["phase"] != "optimizer"
    )
    return sent / BASE["steps"], 4 * sum(p.numel() for p in stage_params(0)), 2


def stage_params(stage):
    torch.manual_seed(0)
    model = tiny_gpt(**FOUR)
    keep = ["tok_emb", "pos_emb", "blocks.0.", "blocks.1."] if stage == 0 else ["blocks.2.", "blocks.3.", "ln_f"]
    return [p for n, p in model.named_parameters() if any(n.startswith(k) for k in keep)]


@pytest.mark.timeout(600)
def test_ddp_under_pp_reduces_each_stage_once_per_step(directory, no_leftover_ranks):
    """m micro-batches, one all-reduce of the stage's gradients: ring 2(N-1)/N of its bytes, not m times that."""
    sent, grad_bytes, n = launched(4, directory)["ddp bytes"]
    assert sent == 2 * (n - 1) * grad_bytes // n


def p2p_bytes() -> dict:
    """One step at pp 2 (world 2), m = 4: what each rank sent, by message kind."""
    torch.manual_seed(0)
    model, opt = toolkit.parallel.wrap(tiny_gpt(**FOUR), "local", pp=2, microbatches=4)
    x, y = SyntheticCorpus().batch(0, 8)
    toolkit.trace.events.recorder.reset()
    model.forward_backward(x, y)
    sends: dict = {}
    for e in toolkit.trace.events.recorder.events:
        if e["name"] == "send":
            key = e["args"]["message"]
            sends[key] = sends.get(key, 0) + e["args"]["bytes_sent"]
    everyone = [None, None]
    dist.all_gather_object(everyone, sends)
    return everyone


@pytest.mark.timeout(600)
def test_stages_send_exactly_the_activations_their_gradients_and_the_tied_weight(directory, no_leftover_ranks):
    """Stage 0 sends m activations of (b/m, s, d) fp32 and the tied embedding (V, d); stage 1 sends their m
    gradients and the head's gradient for the tied weight. Nothing else crosses between stages."""
    b, m, s, d, V = 8, 4, 32, 32, 64
    first, last = launched(2, directory)["p2p"]
    assert first == {"activation": m * (b // m) * s * d * 4, "tied weight": V * d * 4}
    assert last == {"gradient": m * (b // m) * s * d * 4, "tied gradient": V * d * 4}


def activations() -> dict:
    """Bytes autograd keeps, per rank: after the first forward (one micro-batch) and at the step's peak."""
    return {schedule: _activations_under(schedule) for schedule in ("gpipe", "1f1b", "zb-h1")}


def _activations_under(schedule: str) -> tuple:
    torch.manual_seed(0)
    model, _ = toolkit.parallel.wrap(tiny_gpt(**FOUR), "local", pp=2, microbatches=4, schedule=schedule)
    meter = ActivationMeter(model)
    after = []
    model.driver.observers.append(lambda action: after.append(meter.live))
    with meter:
        model.forward_backward(*SyntheticCorpus().batch(0, 8))
    return after[0], meter.peak, meter.live


@pytest.mark.timeout(600)
def test_activation_memory_per_stage_is_the_formula(directory, no_leftover_ranks):
    """GPipe keeps all m micro-batches' activations on every stage; 1F1B at most p - r on stage r (2 on the
    first, 1 on the last); ZB-H1 keeps no more than 1F1B's first stage. Measured bytes = one micro-batch's x
    the count, exactly (every micro-batch of a stage saves the same tensors), and nothing is left after."""
    memory = launched(2, directory)["memory"]  # rank 0: the first stage
    for schedule, (one, peak, left) in memory.items():
        assert left == 0, schedule
        if schedule == "zb-h1":
            assert peak <= 2 * one, (peak, one)
        else:
            assert peak == bubble.formula_in_flight(schedule, 2, 4, 0) * one, (schedule, peak, one)


# --- checkpoints across (dp, pp, tp) layouts -------------------------------------------------------------------
ADAM = functools.partial(torch.optim.AdamW, lr=1e-2)
LOADERS = [("ddp", {}), ("local", {"tp": 2, "pp": 2, "microbatches": 2}), ("zero2", {"pp": 2, "microbatches": 2})]
LOADERS += [
    ("zero3", {"tp": 2, "pp": 2, "microbatches": 2}),
    ("fsdp", {"tp": 2, "pp": 2, "microbatches": 2}),
]  # stages whose parameters are pieces between uses


def checkpoints_across_layouts(directory):
    """Train zero1 at dp 2 x pp 2 and save; load at pp 1 (ddp over 4), at tp 2 x pp 2 (plain and zero3) and back at
    dp 2 x pp 2."""
    from toolkit.parallel.checkpoint import load_full, save_full

    torch.manual_seed(0)
    model, opt = toolkit.parallel.wrap(tiny_gpt(**FOUR, n_head=4), "zero1", optimizer=ADAM, pp=2, microbatches=2)
    for step in range(2):
        dp_rank = toolkit.parallel.mesh.layout(4, pp=2).coordinate(dist.get_rank()).dp  # a pipeline's rows
        model.forward_backward(*SyntheticCorpus().batch(step, 8, rank=dp_rank, world_size=2))
        opt.step()
        opt.zero_grad()
    first = os.path.join(directory, "dp2-pp2.pt")
    save_full(model, opt, first)
    saved = toolkit.parallel.full_state_dict(model)
    found = {}
    for strategy, options in LOADERS:
        torch.manual_seed(1)  # other initial values: only the checkpoint can make them equal
        other, other_opt = toolkit.parallel.wrap(tiny_gpt(**FOUR, n_head=4), strategy, optimizer=ADAM, **options)
        load_full(other, other_opt, first)
        again = os.path.join(directory, f"{strategy}-{sorted(options.items())}.pt")
        save_full(other, other_opt, again)
        state = toolkit.parallel.full_state_dict(other)
        found[strategy] = (all(torch.equal(state[k], saved[k]) for k in saved), set(state) == set(saved), again)
    return first, found


@pytest.mark.timeout(600)
def test_checkpoints_move_between_pipeline_layouts_bit_for_bit(directory, no_leftover_ranks):
    first, found = launched(4, directory)["checkpoints"]
    original = torch.load(first, weights_only=True)
    for strategy, (equal, same_names, again) in found.items():
        assert equal and same_names, strategy
        assert _same(torch.load(again, weights_only=True), original), strategy  # and saved again, the same file


@pytest.mark.timeout(600)
def test_the_timeline_figure_draws_a_real_run(directory, no_leftover_ranks):
    """ZB-H1 at pp 2, m 4: every rank's F, B and W of every micro-batch is a block labelled like the schedule
    prints it, coloured by micro-batch; an arrow for each activation and gradient that crossed."""
    from toolkit.viz import pipeline_timeline, style

    run = launched(2, directory)["zb-h1 run"]
    fig = pipeline_timeline(run, formula=bubble.formula_bubble("zb-h1", 2, 4))
    bars = {t.name: t for t in fig.data}
    assert sorted(bars) == ["backward", "forward", "weight gradients"]
    for name, kind in (("forward", "F"), ("backward", "B"), ("weight gradients", "W")):
        assert sorted(bars[name].text) == sorted(f"{kind}{i}" for i in range(4) for _ in range(2))
        colours = {t: c for t, c in zip(bars[name].text, bars[name].marker.color)}
        assert colours[f"{kind}0"] == style.shade(style.SEQUENCE[0], {"F": 0, "B": 2, "W": 1}[kind])
    assert len(fig.layout.annotations) == 2 * 4  # 4 activations forward, 4 gradients back
    assert "the schedule's formula: 8%" in fig.layout.title.subtitle.text  # (p-1)(F+B-W)/(3m+(p-1)) = 1/13


@pytest.mark.timeout(600)
def test_a_real_run_follows_its_schedule_and_its_bubble_is_the_formulas_with_these_costs(directory, no_leftover_ranks):
    """A real step's actions, on each rank in the schedule's order; replayed at the textbook's costs they give the
    formula exactly, and replayed at their own measured durations, with free communication, they never take
    longer than the real step (a lower bound: a real rank starts no action earlier than the replay does;
    the ranks' clocks agree within a millisecond). Timing-free: nothing here depends on how fast the machine is."""
    run = launched(2, directory)["zb-h1 run"]
    spans = [e for e in run.events if e["cat"] == "compute" and "action" in e["args"] and e["args"]["step"] == 1]
    actions = schedules.build("zb-h1", 2, 4)
    for rank, mine in enumerate(actions):
        ran = [
            (e["args"]["action"], e["args"]["micro"], e["args"]["stage"])
            for e in sorted(spans, key=lambda e: e["start"])
            if e["rank"] == rank
        ]
        assert ran == [tuple(a) for a in mine], rank
    programs = lowering.lower(actions, 2, tied=True)
    busy, span = lowering.busy_and_span(lowering.replay(programs, lowering.unit_cost(True)))
    assert 1 - busy[0] / span == pytest.approx(bubble.formula_bubble("zb-h1", 2, 4), abs=1e-12)
    took = {(e["args"]["action"], e["args"]["micro"], e["args"]["stage"]): e["end"] - e["start"] for e in spans}
    replayed = lowering.busy_and_span(lowering.replay(programs, lambda a: took[tuple(a)]))[1]
    real = max(e["end"] for e in spans) - min(e["start"] for e in spans)
    assert real >= replayed - 1e-3


@pytest.mark.timeout(600)
def test_a_real_bubble_is_the_schedules_at_its_stages_plus_waiting_and_time_between_actions(
    directory, no_leftover_ranks
):
    """What lesson 09 shows: replayed with its own action times and free messages, the step's bubble is at most the
    measured one (the replay is a lower bound); the measured one is exactly the rank's waits for messages plus the
    time between its actions; every message a waiting receiver took has a positive time. Timing-free relations."""
    run = launched(2, directory)["zb-h1 run"]
    programs = lowering.lower(schedules.build("zb-h1", 2, 4), 2, tied=True)
    replayed, real = bubble.replayed_bubble(run, programs), bubble.measured_bubble(run)
    parts = bubble.step_breakdown(run)
    spans = [e for e in run.events if e["cat"] == "compute" and "action" in e["args"] and e["args"]["step"] == 1]
    step = max(e["end"] for e in spans) - min(e["start"] for e in spans)
    for rank in (0, 1):
        assert parts[rank]["actions"] == pytest.approx(1 - real[rank], abs=1e-12)
        assert parts[rank]["waiting"] >= 0 and parts[rank]["between"] >= -1e-12
        assert real[rank] == pytest.approx(parts[rank]["waiting"] + parts[rank]["between"], abs=1e-12)
        # the same busy time over a step at most 1 ms (the clocks' agreement) shorter than the real one
        busy = 1 - real[rank]
        assert busy * step / (1 - replayed[rank]) <= step + 1e-3
    # every step's messages whose receiver was already waiting (in one step under load there may be none)
    steps = {e["args"]["step"] for e in run.events if e["cat"] == "compute" and "action" in e["args"]}
    latency = [t for at in steps for t in bubble.message_latency(run, at)]
    assert latency and min(latency) > 0
