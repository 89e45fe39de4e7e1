"""The simulator under pipeline parallelism: a pipelined rank priced with its whole pipeline, from the pipeline's
own code on the fake process group; one rank per kind of stage put together into every rank's program, as
simulating them all would; the composed step against the pipeline's own dry run; a rank of 4,096; and the
simulated rank against a real gloo run at world 2 and 4 (bytes, model states, the modelled timeline's spans)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import toolkit
from toolkit.models import tiny_gpt
from toolkit.sim import cluster_of, price, simulate
from toolkit.sim.pipelined import pipeline_of

TINY = dict(n_layer=8, d_model=32, n_head=2)
FREE = dict(
    name="free links", gpu="a100-80gb", gpus_per_node=8, intra=("1e9 GB/s", "0 us"), inter=("1e9 GB/s", "0 us")
)  # transfers and collectives cost nothing: only compute and the schedule


def pipelined(
    schedule="1f1b", m=8, v=1, rank=1, strategy="local", world=4, every_stage=False, cluster="dgx-a100", **options
):
    return simulate(
        lambda: tiny_gpt(**TINY),
        strategy,
        world,
        rank=rank,
        pp=4,
        microbatches=m,
        batch_per_rank=m,
        schedule=schedule,
        virtual_stages=v,
        progress=False,
        mixed_precision=True,
        cluster=cluster,
        every_stage=every_stage,
        **options,
    )


def shape(program) -> list:
    """A program as what it does: each instruction's kind, operation, FLOPs or bytes, peer and phase."""
    return [
        (
            type(i).__name__,
            getattr(i, "op", None),
            getattr(i, "flops", None),
            getattr(i, "size_bytes", None),
            getattr(i, "args", {}).get("peer"),
            i.phase,
        )
        for i in program
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule, m, v", [("1f1b", 8, 1), ("interleaved", 16, 2), ("1f1b", 5, 1)])
def test_one_rank_per_kind_of_stage_gives_every_ranks_program_as_simulating_them_all(schedule, m, v):
    """Four stages: the first (embedding), two alike, the last (head and loss). Simulating one of each with
    the fewest micro-batches (1F1B: pp + 1; interleaved: 2 pp) and putting every rank's program together in
    the order of the pipeline's lowering gives, instruction for instruction, the programs of simulating every
    rank with every micro-batch. One difference, known: before its first action the driver copies each
    micro-batch's token ids and targets (2 copies per micro-batch), and the put-together program keeps its
    representative's (2 m' of them): every rank starts later by those copies' launches, and so does the step.
    With as few micro-batches as a representative needs (1F1B's pp + 1 = 5) one rank of each kind is still all
    that is simulated (Llama 3's 16 stages with 16 micro-batches: 3 simulations, not 16)."""
    from toolkit.sim.cost import compute_time

    fast, every = pipelined(schedule, m, v), pipelined(schedule, m, v, every_stage=True)
    fewer = fast.simulated_microbatches
    assert fewer == min(m, 2 * 4 if v > 1 else 4 + 1) and not hasattr(every, "simulated_microbatches")
    assert set(fast.stage_peaks) == {0, 1, 3} and set(every.stage_peaks) == {0, 1, 2, 3}  # ranks simulated
    gpu = cluster_of("dgx-a100").gpu
    for rank in range(4):
        mine, all_of_it = fast.stage_sims[rank].programs[-1], every.stage_sims[rank].programs[-1]
        assert shape(mine[1:]) == shape(all_of_it[1:]), rank
        assert [k.name for k, n in all_of_it[0].kernels for _ in range(n)].count("clone") == 2 * m
        assert [k.name for k, n in mine[0].kernels for _ in range(n)].count("clone") == 2 * fewer
    later = compute_time(every.programs[-1][0], gpu) - compute_time(fast.programs[-1][0], gpu)
    assert (later > 0 if fewer < m else later == 0) and fast.step_time == pytest.approx(
        every.step_time - later, rel=1e-12
    )
    assert fast.bytes_per_phase == every.bytes_per_phase


@pytest.mark.timeout(600)
def test_the_composed_step_is_the_pipelines_own_dry_run_of_its_actions():
    """Two implementations of one schedule: the cost model's stage timeline on the recorded programs, and the
    pipeline's own dry run (`lowering.replay`) of its lowered actions. Each action priced as the cost model
    prices it (its operations on the DGX A100 preset) and everything else free, they agree exactly: the step,
    and each rank's busy time; the last stage (its blocks, the head and the loss: the heaviest) idles least.
    A backward sends its input's gradient from inside (the driver); the dry run sends it after the action, so what
    a backward computes after that send (the last stage: the tied head's gradient added to the last one's) is
    free here."""
    from toolkit.parallel.pipeline import lowering, schedules
    from toolkit.sim.kernel_time import segment_seconds
    from toolkit.sim.pipelined import stage_timelines
    from toolkit.sim.program import Collective, Compute
    from toolkit.sim.stage_assembly import _action

    sim = pipelined()
    gpu = cluster_of("dgx-a100").gpu

    class Free:
        seconds, resources = 0.0, ()

    tails = set()  # the computes of an action after its send from inside
    for program in (program for s in sim.stage_sims.values() for program in s.programs):
        action, sent = None, False
        for ins in program:
            if isinstance(ins, Collective) and ins.args.get("within"):
                sent = True
            elif isinstance(ins, Compute) and _action(ins) and _action(ins) != action:
                action, sent = _action(ins), False
            elif isinstance(ins, Compute) and _action(ins) and sent:
                tails.add(id(ins))
    assert tails  # the last stage's: the tied head's gradient accumulated

    def priced(rank, c):
        return segment_seconds(c, gpu)[0] if _action(c) and id(c) not in tails else 0.0

    stages = stage_timelines(sim.stage_sims, priced, lambda rank, c: Free())[-1]
    seconds: dict = {}
    for timeline in stages.stages.values():
        for span in timeline.spans:
            if span.kind == "compute" and _action(span.instruction):
                key = _action(span.instruction)
                seconds[key] = seconds.get(key, 0.0) + span.end - span.start
    programs = lowering.lower(schedules.build("1f1b", 4, 8), 4, tied=sim.pipeline_info["tied"] is not None)
    busy, span = lowering.busy_and_span(lowering.replay(programs, lambda a: seconds[(a.kind, a.micro, a.stage)]))
    assert span == pytest.approx(stages.step_time, rel=1e-12)
    assert busy == pytest.approx([stages.stages[r].compute for r in range(4)], rel=1e-12)
    assert min(range(4), key=stages.bubble) == 3


@pytest.mark.timeout(900)
def test_a_rank_of_4096_in_a_dp_x_pp_x_tp_layout():
    """dp 64 x pp 8 x tp 8 on DGX A100 nodes: tp fills a node, so every stage of a pipeline is on a node of its
    own and every transfer crosses the network; three kinds of stage simulated (first, middle, last), the
    step the pipeline's; the rank's memory is its own, and the last stage (one micro-batch in flight under 1F1B)
    holds less than a middle one (seven); its sends are its 1/8 of each of its 16 activations (the tp group's
    scatter/gather) and, once, its tp piece of the tied embedding for the last stage's head."""
    config = dict(n_layer=8, d_model=64, n_head=8, vocab_size=64, seq_len=32)
    sim = simulate(
        lambda: tiny_gpt(**config),
        "zero1",
        4096,
        rank=257,
        tp=8,
        pp=8,
        microbatches=16,
        batch_per_rank=16,
        progress=False,
        mixed_precision=True,
        cluster="dgx-a100",
    )
    ranks = [257 + 512 * p for p in range(8)]  # dp 32, every pp index, tp 1 (Megatron's order: pp outermost)
    assert sorted(sim.stage_sims) == ranks and sorted(sim.stage_peaks) == [257, 769, 3841]
    transfers = [
        s
        for t in sim.cost.stages[-1].stages.values()
        for s in t.spans
        if s.kind == "comm" and s.instruction.op in ("send", "recv")
    ]
    assert transfers and {s.cost.link for s in transfers} == {"inter-node"}
    assert sim.step_time == sim.cost.stages[-1].step_time > 0 and sim.breakdown["bubble"] > 0
    assert sim.stage_peaks[3841] < sim.stage_peaks[769]
    sends = [c.size_bytes for c in sim.collectives() if c.op == "send"]
    activation, tied = 1 * config["seq_len"] * config["d_model"] * 2, config["vocab_size"] // 8 * config["d_model"] * 2
    assert sorted(sends) == sorted([activation // 8] * 16 + [tied])  # each tp rank sends 1/t (scatter/gather)
    inside = simulate(
        lambda: tiny_gpt(**config),
        "zero1",
        4096,
        rank=257,
        tp=8,
        pp=8,
        microbatches=16,
        batch_per_rank=16,
        progress=False,
        mixed_precision=True,
    )  # no cluster: this rank alone
    tp_group = set(range(256, 264))  # inside one node; dp, the pipeline's loss and every send cross nodes
    assert sum(c.bytes_sent for c in inside.collectives() if c.op == "send") == sum(sends)
    assert inside.cross_node_bytes == sum(c.bytes_sent for c in inside.collectives() if set(c.group) != tp_group)


def test_a_send_crosses_the_network_only_to_a_peer_on_another_node():
    """tp 2 x pp 8 on nodes of 8: a pipeline (ranks 0, 2, ..., 14) spans two nodes, but stage 0's activations go to
    rank 2, on its own node, and do not cross the network (its tied embedding for the last stage, rank 14, does);
    stage 3 (rank 6) sends its activations to rank 8, on the next node."""

    def rank(r):
        return simulate(
            lambda: tiny_gpt(n_layer=8, d_model=32, n_head=2),
            "local",
            16,
            rank=r,
            tp=2,
            pp=8,
            microbatches=8,
            batch_per_rank=8,
            progress=False,
        )

    first, fourth = rank(0), rank(6)
    sent = {r: sum(c.bytes_sent for c in s.collectives() if c.op == "send") for r, s in ((0, first), (6, fourth))}
    assert sent[0] > 0 and sent[6] > 0
    tied = [c.bytes_sent for c in first.collectives() if c.op == "send" and c.args["peer"] == 14]
    assert len(tied) == 1 and first.cross_node_bytes == tied[0] + sum(
        c.bytes_sent for c in first.collectives() if c.op != "send" and len({r // 8 for r in c.group}) > 1
    )
    activations = sum(c.bytes_sent for c in fourth.collectives() if c.op == "send" and c.args["peer"] == 8)
    assert activations > 0 and fourth.cross_node_bytes >= activations


@pytest.mark.timeout(900)
def test_one_and_two_blocks_per_stage_extrapolate_to_four_exactly():
    """A pipeline's blocks are alike: every action's work, the transfers, the bubble and the peak grow by the same
    amount with each block per stage, so `sweep.extrapolate` from one and two blocks per stage (`PIPELINE_BASE`)
    gives the four-block simulation's step, its parts and its peak (while the slowest stage stays the slowest:
    here the last, with the head and the loss). Within 0.5% of the step, not exactly: how long compute runs beside
    collectives in flight depends on where DDP's buckets fall among the blocks, which is not affine in them (a few
    microseconds of a step of milliseconds here)."""
    from toolkit.sim.sweep import PIPELINE_BASE, extrapolate

    def at(blocks):
        return simulate(
            lambda: tiny_gpt(n_layer=4 * blocks, d_model=256, n_head=4, seq_len=256, vocab_size=512),
            "ddp",
            8,
            pp=4,
            microbatches=8,
            batch_per_rank=8,
            progress=False,
            mixed_precision=True,
            cluster="dgx-a100",
        )

    one, two, four = at(1), at(2), at(4)
    out = extrapolate(one, two, 4, PIPELINE_BASE)
    for part, seconds in four.breakdown.items():  # within 0.5% of the step: compute beside collectives moves them
        assert out["breakdown"][part] == pytest.approx(seconds, rel=1e-9, abs=5e-3 * four.step_time), part
    alone = [price(sim, cluster_of("dgx-a100", published=None)) for sim in (one, two, four)]  # nothing beside
    for part, seconds in alone[2].breakdown.items():  # collectives: every part exactly, as before
        first, second = alone[0].breakdown[part], alone[1].breakdown[part]
        assert first + (4 - 1) * (second - first) == pytest.approx(seconds, rel=1e-9, abs=1e-15), part
    assert out["peak"] == pytest.approx(four.peak, rel=1e-12)


def test_a_deeper_pipelines_peak_is_extrapolated_moment_by_moment():
    """Under context parallelism a stage of one block peaks in its second micro-batch's backward (the ring's
    buffers beside the first's gradients), a stage of two or four in the first's, where the other micro-batch's
    activations are still held: extrapolating each one's peak category by category mixes the two moments and falls
    short (-2.5% here); `sweep.deepest_peak` extrapolates every moment (pass, module by its place, which of the
    stage's forwards and backwards) and takes the highest: within 1% of the four-block simulation, above it (a lone
    block is both the first and the last)."""
    from toolkit.sim.sweep import deepest_peak

    def at(blocks):
        return simulate(
            lambda: tiny_gpt(n_layer=2 * blocks, d_model=256, n_head=4, seq_len=16384, vocab_size=50304),
            "fsdp",
            64,
            tp=2,
            cp=4,
            pp=2,
            microbatches=2,
            batch_per_rank=2,
            sequence_parallel=True,
            mixed_precision=True,
            progress=False,
        )

    one, two, four = at(1), at(2), at(4)
    assert one.peak_moment["module"] == "blocks.0.attn" and four.peak_moment["module"] == "blocks.3.attn"
    to_four = lambda x, y: x + 3 * (y - x)  # noqa: E731 - PIPELINE_BASE (1, 2) to four blocks
    by_moment = sum(deepest_peak(one, two, to_four).values())
    by_category = sum(to_four(one.peak_memory[k], two.peak_memory[k]) for k in one.peak_memory)
    assert four.peak <= by_moment <= 1.01 * four.peak
    assert by_category < 0.98 * four.peak


# --- against real runs ------------------------------------------------------------------------------------------
SMALL = dict(n_layer=4, d_model=32, n_head=2)
BATCH = 4  # rows per replica: the micro-batches
CASES = {
    2: [("local", dict(pp=2, microbatches=4))],
    4: [
        ("ddp", dict(pp=2, microbatches=4, mixed_precision=True)),
        ("zero1", dict(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)),
    ],
}


def real_runs(cases):
    """On every real rank: two steps of each case through `toolkit.train`, what the Run says of the second (the
    simulator's is a second step too: DDP rebuilds its buckets in it); and the model states as the simulator
    counts them, every one alive (after the update, before zero_grad), from its own step on these real ranks."""
    from toolkit.models import SyntheticCorpus
    from toolkit.sim.simulate import measure_steps, train_step
    from toolkit.trace.analysis import bytes_per_step
    from toolkit.train import TrainConfig, train

    rank, world = dist.get_rank(), dist.get_world_size()
    found = []
    for strategy, options in cases:
        dp = world // options["pp"]
        run = train(
            TrainConfig(
                strategy=strategy,
                steps=2,
                global_batch_size=BATCH * dp,
                model=SMALL,
                options=dict(options),
                progress=False,
            )
        )
        model, opt = toolkit.parallel.wrap(tiny_gpt(**SMALL), strategy, **options)
        x, y = SyntheticCorpus().batch(0, BATCH * dp, rank=rank // (world // dp), world_size=dp)
        train_step(model, opt, x, y, step=0)
        states = measure_steps(model, opt, x, y, 1, first=1)["memory"]
        found.append(
            {"bytes": bytes_per_step(run, rank)[-1], "states": {k: states[k] for k in STATES}, **structure(run, rank)}
        )
    return found


STATES = ("params", "grads", "optimizer")


def structure(run, rank, last_step=None) -> dict:
    """The last step's collectives (op, message) in issue order and its pipeline actions in start order (a modelled
    transfer starts when both sides are there: it was issued `queued_s` before, `issue_order`-th)."""
    from toolkit.trace.analysis import step_windows

    start, end = step_windows(run, rank)[-1]
    events = sorted(
        (
            e
            for e in run.events
            if e["rank"] == rank
            and start <= e["start"] < end
            and (last_step is None or e["args"].get("step") == last_step)
        ),
        key=lambda e: (e["start"] - e["args"].get("queued_s", 0.0), e["args"].get("issue_order", 0)),
    )
    return {
        "collectives": [(e["name"], e["args"].get("message")) for e in events if e["cat"] == "comm"],
        "actions": [
            (e["args"]["action"], e["args"]["micro"], e["args"]["stage"])
            for e in events
            if e["cat"] == "compute" and "action" in e["args"]
        ],
    }


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_simulated_pipeline_rank_equals_a_real_gloo_run(world, no_leftover_ranks):
    """The last rank (the last stage: head, loss, the borrowed tied weight) simulated, priced with its pipeline
    (and at world 4 put together from fewer micro-batches), against the same training on real gloo ranks: the
    bytes it sends per phase (sends, receives, the data-parallel reduction) and its model states exactly; its
    modelled timeline has the real trace's collectives and pipeline actions, in the same order."""
    rank = world - 1
    sims = [
        simulate(
            lambda: tiny_gpt(**SMALL),
            strategy,
            world,
            rank=rank,
            batch_per_rank=BATCH,
            ranks_per_node=2,
            progress=False,
            cluster="dgx-a100",
            **options,
        )
        for strategy, options in CASES[world]
    ]
    real = toolkit.launch(real_runs, world, args=(CASES[world],), timeout_s=120, quiet=True)
    for (strategy, options), sim, measured in zip(CASES[world], sims, real[rank]):
        case = f"{strategy} {options} rank {rank}/{world}"
        assert sim.bytes_per_phase == measured["bytes"], case
        assert {k: sim.memory[k] for k in STATES} == measured["states"], case
        assert structure(sim.modelled_run, rank, last_step=len(sim.programs) - 1) == {
            k: measured[k] for k in ("collectives", "actions")
        }, case


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2)])
def test_what_a_stage_keeps_to_the_steps_end_is_its_micro_batches_token_ids_not_activations(schedule, v):
    """Every received activation and gradient is let go by the action that uses it; what grows with the
    micro-batches to the step's end is the driver's copy of each one's token ids, inputs and targets (16 bytes a
    token), which the simulated memory counts. An activation kept per micro-batch would add 2 x 32 x 64 x 4 B =
    16 KiB each."""
    for rank in pipeline_of(4, 0, dict(pp=2)):  # the first stage and the last (ranks in the mesh's order)
        ends = []
        for m in (4, 8):
            sim = simulate(
                lambda: tiny_gpt(n_layer=4, d_model=64, n_head=4),
                "ddp",
                4,
                rank=rank,
                pp=2,
                microbatches=m,
                schedule=schedule,
                virtual_stages=v,
                batch_per_rank=2 * m,
                progress=False,
                steps=1,
                warmup=False,
            )
            ends.append(sim.end_memory["activations"])
        token_ids = 2 * 2 * sim.seq_len * 8  # one micro-batch: inputs and targets, 2 sequences of int64 ids each
        assert ends == [4 * token_ids, 8 * token_ids], (rank, ends)


@pytest.mark.timeout(900)
def test_a_pipeline_whose_shallow_stages_hide_their_bubble_is_simulated_whole():
    """FSDP under pp gathers the embedding again for every micro-batch, and how much of that wait the bubble covers
    changes with the blocks per stage, so the step is not affine in them (extrapolated from one and two to four:
    -1.7% here, at d_model 256). `simulate_depths` checks the extrapolation at `PIPELINE_CHECK` blocks and,
    missing it by more than `AFFINE`, simulates the whole stage: its numbers are the whole simulation's."""
    from toolkit.sim.sweep import AFFINE, PIPELINE_BASE, PIPELINE_CHECK, extrapolate, simulate_depths

    sims = {}

    def at(blocks):
        sims[blocks] = simulate(
            lambda: tiny_gpt(n_layer=4 * blocks, d_model=256, n_head=4, seq_len=256, vocab_size=50304),
            "fsdp",
            8,
            pp=4,
            microbatches=8,
            batch_per_rank=8,
            ranks_per_node=1,
            progress=False,
            mixed_precision=True,
            cluster="dgx-a100",
        )
        return sims[blocks]

    row, whole = simulate_depths(at, 6, pipelined=True)
    assert list(sims) == [*PIPELINE_BASE, PIPELINE_CHECK, 6] and row["checked"].startswith("simulated whole")
    assert row["breakdown"]["step"] == pytest.approx(whole.cost.step_time, rel=1e-12) and row["peak"] == pytest.approx(
        whole.peak, rel=1e-12
    )
    guess = extrapolate(sims[1], sims[2], PIPELINE_CHECK, PIPELINE_BASE)["breakdown"]["step"]
    assert abs(guess / sims[PIPELINE_CHECK].cost.step_time - 1) > AFFINE


def test_an_fsdp_stage_starts_gathering_its_units_before_its_first_activation_arrives():
    """FSDP that keeps its units gathered through the step under pp (reshard_after_forward=False, as torchtitan and
    Llama 3 run it) gathers a stage's units one action before that stage's first forward (`FSDPModel.unshard_ahead`,
    as torch's pipelining issues an UNSHARD ahead of a stage's first use), not after its activation has arrived: on
    the second rank of pp 2 with 2 virtual stages (blocks 1 and 3), each block's all-gather is issued before the rank
    waits for its virtual stage's first activation, so it runs while the rank waits or computes. Issued after that
    wait, every stage's gathers lay end to end along the pipeline's fill, once per virtual stage."""
    sim = simulate(
        lambda: tiny_gpt(n_layer=4, d_model=32, n_head=2),
        "fsdp",
        4,
        rank=3,
        pp=2,
        microbatches=2,
        batch_per_rank=2,
        schedule="interleaved",
        virtual_stages=2,
        reshard_after_forward=False,
        progress=False,
    )
    program = sim.programs[0]
    where = {getattr(op, "id", None): n for n, op in enumerate(program) if type(op).__name__ == "Wait"}
    for block, fed_by in (("blocks.1", 0), ("blocks.3", 2)):
        (gather,) = [
            n for n, op in enumerate(program) if getattr(op, "op", None) == "all_gather" and op.args["unit"] == block
        ]
        (recv,) = [
            op.id
            for op in program
            if getattr(op, "op", None) == "recv"
            and (op.args.get("message"), op.args.get("micro")) == ("activation", 0)
            and op.args.get("stage") == fed_by
        ]
        assert gather < where[recv], (block, gather, where[recv])
