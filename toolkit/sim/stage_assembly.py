"""A pipeline at scale: one rank of each kind of stage simulated, every rank's program put back together.

At scale (pp = 64, 512 micro-batches) simulating every micro-batch of every stage would take an hour, and
most of it repeats: stages that hold the same blocks (all but the first and the last) run the same
actions in another order, and every micro-batch but the first and the last runs the same work. So by
default (`every_stage=False`) one rank of each kind of stage is simulated (`stage_classes`: the first, a
middle and the last, or as many as the blocks' split makes), with the fewest micro-batches its schedule
needs to reach its peak memory (`reduced_microbatches`; all of them where there are no more); its program is
cut into each action's work (`chunks`: the compute and the tensor- and data-parallel collectives between two
point-to-point transfers), and every rank's program for the real number of micro-batches is put back together
in the order of the pipeline's own schedule and its sends and receives (`assemble`, through
`toolkit.parallel.pipeline`'s lowering, its mailbox's receive order included). Tests hold the result to
simulating every micro-batch of every stage (`every_stage=True`), to the instruction.
"""

from __future__ import annotations

import dataclasses

from .pipelined import pipeline_of
from .program import Collective, Compute, Wait
from .stage_timeline import is_transfer


def simulate_pipeline(
    simulate_rank,
    price,
    *,
    world_size: int,
    rank: int,
    batch_per_rank: int,
    steps: int,
    every_stage: bool,
    options: dict,
):
    """Rank `rank` of a pipelined job, simulated and priced with its whole pipeline: simulate_rank(rank=,
    batch_per_rank=, steps=, **options) simulates one rank of the job (unpriced); price(sim, stage_sims) prices
    them together (`cost.pricer`). The Simulation returned has its own memory and, for every micro-batch, its
    program."""
    pp, m = options["pp"], options.get("microbatches") or options["pp"]
    schedule = options.get("schedule", "1f1b")
    ranks = pipeline_of(world_size, rank, options)
    fewer = m if every_stage else reduced_microbatches(schedule, pp, m)
    if batch_per_rank % m:  # the pipeline's own error, said before any simulation
        simulate_rank(rank=rank, batch_per_rank=batch_per_rank, steps=steps, **options)
    smaller = dict(options, microbatches=fewer)
    sim = simulate_rank(rank=rank, batch_per_rank=batch_per_rank // m * fewer, steps=steps, **smaller)
    info = sim.pipeline_info
    if every_stage:  # every rank simulated with every micro-batch
        sim.stage_sims = {
            r: sim if r == rank else simulate_rank(rank=r, batch_per_rank=batch_per_rank, steps=steps, **options)
            for r in ranks
        }
        sim.stage_peaks = {r: s.peak for r, s in sim.stage_sims.items()}
        price(sim, sim.stage_sims)
        return sim
    from ..parallel.pipeline import lowering, schedules

    classes = stage_classes(info["split"], pp)
    me = ranks.index(rank)
    simulated = {
        p: sim
        if p == me
        else simulate_rank(rank=ranks[p], batch_per_rank=batch_per_rank // m * fewer, steps=steps, **smaller)
        for p in sorted(set(classes.values()) | {me})
    }
    pieces = {}
    lowered = lowering.lower(
        schedules.build(info["schedule"], pp, m, info["virtual_stages"]), pp, tied=info["tied"] is not None
    )
    order = lowering.send_order(lowered)
    assembled = []
    for k in range(steps):
        for p in set(classes.values()):
            pieces[p] = chunks(simulated[p].programs[k])
        assembled.append(assemble(lowered, pp, m, fewer, ranks, classes, pieces, order))
    sim.programs = [programs[rank] for programs in assembled]
    sim.batch_per_rank, sim.options = batch_per_rank, dict(sim.options, microbatches=m)
    sim.stage_sims = {
        r: sim
        if r == rank
        else dataclasses.replace(simulated[classes[p]], rank=r, programs=[programs[r] for programs in assembled])
        for p, r in enumerate(ranks)
    }
    sim.stage_peaks = {ranks[p]: s.peak for p, s in simulated.items()}
    sim.simulated_microbatches = fewer
    price(sim, sim.stage_sims)
    return sim


# --- at scale: one rank per kind of stage, its work per action, every rank's program put back together ------------
def reduced_microbatches(schedule, pp: int, microbatches: int) -> int:
    """Micro-batches enough for a representative rank: a first, a middle and a last one, and its steady state,
    where as many are in flight as the schedule ever keeps while gradients have accumulated (1F1B and ZB-H1:
    pp + 1; interleaved: 2 pp, a multiple of pp); GPipe keeps every micro-batch in flight: all of them, and so
    does an interleaved schedule whose m is no multiple of pp (its groups, hence its warm-up, depend on m itself)."""
    if schedule == "gpipe" or not isinstance(schedule, str) or (schedule == "interleaved" and microbatches % pp):
        return microbatches
    return min(microbatches, 2 * pp if schedule == "interleaved" else max(pp + 1, 3))


def stage_classes(split, pp: int) -> dict:
    """{pipeline rank: the representative rank whose stages hold as many blocks and the same ends (the
    embedding, the head)}: ranks of one class run the same work per action."""
    stages = len(split.stages)
    kinds: dict = {}
    out = {}
    for p in range(pp):
        kind = tuple((len(split.stages[s]), s == 0, s == stages - 1) for s in range(p, stages, pp))
        out[p] = kinds.setdefault(kind, p)
    return out


@dataclasses.dataclass(frozen=True)
class SentWithin:
    """Where, among its action's work, a send issued from inside that action goes (a backward's input gradient,
    sent before the data-parallel strategy's end of backward: `toolkit.parallel.pipeline.driver`)."""

    message: str


def _action(c: Compute):
    for _, _, _, args in reversed(c.spans):
        if "action" in args:
            return args["action"], args["micro"], args["stage"]
    return None


def _key(c: Collective) -> tuple:
    return c.op, c.args.get("message"), c.args.get("micro"), c.args.get("stage")


def chunks(program) -> tuple[list, list, dict, list, dict]:
    """(prologue, setup, {(kind, micro, stage): instructions}, epilogue, {(op, message kind, micro, stage):
    (the transfer's prelude, the transfer, the phase it is waited for in)}) of a pipeline rank's recorded program.
    The prologue comes before the mailbox posts its first receives, the setup between those and the schedule's
    first step. An action's work is its compute and the collectives among it; what lies between two actions goes
    with the one before when a transfer follows it (its trailing waits, a last bucket's all-reduce), else with the
    one after (an FSDP unit's gather before its first operation). A transfer is its send or receive with the
    operations outside every action just before it (a receive's buffer). A send issued from inside an action
    (args "within") leaves a `SentWithin` at its place in that action's work."""
    p2p = {c.id: c for c in program if is_transfer(c)}
    prologue, setup, found, pending, current, transfers = [], [], {}, [], None, {}
    posting, looping = True, False  # the mailbox posts its first receives, then the schedule's loop runs
    for ins in program:
        waits_on_p2p = isinstance(ins, Wait) and ins.id in p2p
        action = _action(ins) if isinstance(ins, Compute) else None
        sends = isinstance(ins, Collective) and ins.id in p2p and ins.op == "send"
        if not looping and (waits_on_p2p or sends or action is not None):
            looping, setup, pending = True, pending, []
        if waits_on_p2p:
            key = _key(p2p[ins.id])
            transfers[key] = transfers[key][:2] + (ins.phase,)  # the phase its wait is in (a send's: the reap's)
            if current is not None:
                found[current] += pending
                pending = []
            continue
        if isinstance(ins, Collective) and ins.id in p2p:
            cut = len(pending)
            while cut and isinstance(pending[cut - 1], Compute):
                cut -= 1
            a = ins.args
            transfers[_key(ins)] = (pending[cut:], ins, ins.phase)
            pending = pending[:cut]
            if a.get("within"):
                found[current] += pending + [SentWithin(a.get("message"))]
                pending = []
            elif posting:
                prologue, pending, posting = prologue + pending, [], not looping
            elif current is not None:
                found[current] += pending
                pending = []
            continue
        if action is None:
            pending.append(ins)
            continue
        posting = False
        found.setdefault(action, []).extend(pending + [ins])
        pending, current = [], action
    return prologue, setup, found, pending, transfers


def assemble(
    lowered, pp: int, microbatches: int, represented: int, ranks: list, rank_of_class: dict, pieces: dict, order: dict
) -> dict:
    """Every pipeline rank's program for `microbatches` micro-batches: lowered[p] (the pipeline's lowering of
    its schedule) with each action replaced by its representative's work for that micro-batch's kind (the first,
    a middle one, the last of `represented`) and each transfer by the representative's transfer of that kind, as
    the mailbox issues them (`p2p.Mailbox`): the receive of each peer's next message posted ahead, in the order
    that peer sends them (`order`), and waited for where it is needed; sends waited for after the next action,
    as the mailbox reaps them (`p2p.Mailbox.reap`: on the simulated cluster
    every send is complete by then). ranks: pipeline rank -> global rank; pieces: {representative: `chunks` of its
    program}. Collective ids are renumbered per program."""

    def micro_of(i: int) -> int:
        return 0 if i == 0 else represented - 1 if i == microbatches - 1 else min(1, represented - 1)

    return {
        ranks[p]: _rank_program(p, ops, ranks, rank_of_class[p], pieces[rank_of_class[p]], order, micro_of)
        for p, ops in enumerate(lowered)
    }


def _rank_program(p: int, ops: list, ranks: list, rep: int, piece: tuple, order: dict, micro_of) -> list:
    """Pipeline rank p's program (`assemble`): its lowered ops with its representative `rep`'s pieces."""
    from ..parallel.pipeline.lowering import Recv, Send

    me = ranks[p]
    prologue, setup, found, epilogue, transfers = piece
    out, sends, ids, renamed = [], [], iter(range(1 << 62)), {}
    expected = {src: list(messages) for (src, dst), messages in order.items() if dst == p}
    posted: dict = {}  # peer -> (message, receive's id) posted ahead
    waited_in: dict = {}  # a transfer's id -> the phase its wait is in
    early: set = set()

    def copy(instructions, action=None, within=None):
        for ins in instructions:
            if isinstance(ins, SentWithin):
                sends.append(transfer("send", within.message, within.peer))
            elif isinstance(ins, Collective):
                renamed[ins.id] = next(ids)  # (a wait may come in a later piece: the loss's all-reduce)
                out.append(dataclasses.replace(ins, id=renamed[ins.id]))
            elif isinstance(ins, Wait):
                out.append(Wait(renamed[ins.id], ins.phase))
            elif action is not None and _action(ins) is not None:  # the action's span says which it is
                out.append(
                    dataclasses.replace(
                        ins,
                        spans=tuple(
                            (
                                ("action", me) + tuple(action),
                                name,
                                cat,
                                dict(args, micro=action.micro, stage=action.stage, rank=p),
                            )
                            if "action" in args
                            else (key, name, cat, args)
                            for key, name, cat, args in ins.spans
                        ),
                    )
                )
            else:
                out.append(ins)

    def transfer(op: str, message, peer: int) -> Collective:
        micro = micro_of(message.micro) if message.micro >= 0 else message.micro
        prelude, c, phase = transfers[(op, message.kind, micro, message.stage - p + rep)]
        out.extend(prelude)
        c = dataclasses.replace(
            c,
            id=next(ids),
            group=tuple(ranks),
            args=dict(c.args, peer=ranks[peer], message=message.kind, micro=message.micro, stage=message.stage),
        )
        out.append(c)
        waited_in[c.id] = phase
        return c

    def post(peer: int) -> None:  # the mailbox posts the receive of a peer's next message ahead
        if expected[peer]:
            message = expected[peer].pop(0)
            posted[peer] = (message, transfer("recv", message, peer))

    copy(prologue)
    for peer in expected:
        post(peer)
    copy(setup)
    skip = None  # a Send already issued inside its action
    for k, op in enumerate(ops):
        if op is skip:
            continue
        if isinstance(op, Send):
            sends.append(transfer("send", op.message, op.peer))
        elif isinstance(op, Recv):
            if op.message in early:
                early.discard(op.message)
                continue
            while op.peer in posted:  # wait for what was posted, post the next, until it is the one needed
                message, c = posted.pop(op.peer)
                out.append(Wait(c.id, waited_in[c.id]))
                post(op.peer)
                if message == op.message:
                    break
                early.add(message)
        else:
            local = op.stage - p + rep  # the representative's stage at the same place
            work = found[(op.kind, micro_of(op.micro), local)]
            skip = next((ins for ins in work if isinstance(ins, SentWithin)), None) and ops[k + 1]
            copy(work, op, skip)
            out += [Wait(c.id, waited_in[c.id]) for c in sends]  # the mailbox reaps the sends
            sends = []
    out += [Wait(c.id, waited_in[c.id]) for c in sends]
    copy(epilogue)
    return out
