"""Several ranks' programs replayed together: the pipeline's stages, joined by their sends and receives.

One rank's program becomes a timeline by the overlap rule (`toolkit.sim.timeline`). A pipeline step is
several such programs, one per stage, that wait on each other: stage s+1 cannot run micro-batch m's
forward before stage s has sent it the activations, and stage s cannot run its backward before stage
s+1 has sent the gradients back. The step time is then the critical path across the stages, and a
stage's idle time on it is the pipeline's bubble. Nothing here knows the schedule (GPipe, 1F1B,
interleaved): the programs carry it, in the order each stage issued its work, and `P2P` pairs say
which send feeds which receive.

The rules, on top of the overlap rule (every stage has its own compute stream and its own links):

1. A send and its receive are one transfer. It starts when both have been issued (NCCL's
   point-to-point needs both sides) and the channel from the sender to the receiver is free, and
   lasts what `collective_cost` gives the send (its link: NVLink between stages of one node, the
   network between nodes). Both collectives complete at its end. Which send feeds which receive:
   `P2P` pairs, or `pair_transfers`, which matches them in order, as NCCL does between two ranks.
2. A `Wait` on a receive stalls that stage's compute stream until the transfer has completed; a
   stage's later instructions wait with it (a stage runs its program in order). A `Wait` on a send does
   not: a sender hands its data over and goes on (the runtime lets go of sends that have completed and
   waits for the rest only at the step's end, whose time includes every transfer anyway).
3. Point-to-point transfers use a channel per direction between two stages (`("p2p", sender, receiver)`):
   activations going down and gradients coming back do not wait for each other (the links are full
   duplex), two transfers the same way take turns, and none waits behind the stage's data-parallel or
   tensor-parallel collectives (NCCL runs them on other streams; what it leaves out: a transfer and a
   collective that cross the same network card share it at full speed each). The stage's other
   collectives follow rules 2-7 of the overlap rule as on one rank; a transfer slows the compute of both its
   stages while in flight (rule 6), but not compute a stage had already scheduled before its other half was
   issued.
4. Stages advance as far as their dependencies allow; if none can and work remains, the programs
   deadlock (a receive whose send is never issued, or two stages each waiting to receive first): an
   error names every stage's blocked instruction.

    timeline = schedule_stages({0: program0, 1: program1}, [P2P(send=(0, 3), recv=(1, 0)), ...],
                               compute_time=lambda stage, c: ..., collective_cost=lambda stage, c: ...)
    timeline.step_time, timeline.stages[1].spans, timeline.bubble(1), timeline.breakdown(1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .program import Collective, Compute, Wait
from .timeline import Links, Span, Timeline, cores_held, held, run_on, slowed


@dataclass(frozen=True)
class P2P:
    """A send on one stage and the receive that takes it on another: (stage, collective id) each."""

    send: tuple
    recv: tuple


@dataclass
class StagesTimeline:
    """Every stage's modelled spans (a `Timeline` each, on one clock) and the step's critical path."""

    stages: dict = field(default_factory=dict)  # stage -> Timeline
    start: float = 0.0

    @property
    def end(self) -> float:
        return max(t.end for t in self.stages.values())

    @property
    def step_time(self) -> float:
        return self.end - self.start

    def bubble(self, stage) -> float:
        """The fraction of the step `stage`'s compute stream is idle: waiting on a transfer, or done early."""
        return 1.0 - self.stages[stage].compute / self.step_time if self.step_time > 0 else 0.0

    def breakdown(self, stage) -> dict:
        """Seconds of the step on `stage`'s compute stream: compute; "bubble", waiting for another stage to
        issue the other half of a transfer (its compute, on the critical path) or done before the step's end;
        "p2p", waiting while a transfer it needs is on the wire; "exposed_comm", waiting for its own
        collectives (tensor- and data-parallel); and the step. They add up to the step (its compute stream's time,
        from the step's start to the step's end)."""
        timeline, out = (
            self.stages[stage],
            {"compute": self.stages[stage].compute, "bubble": 0.0, "p2p": 0.0, "exposed_comm": 0.0},
        )
        transfers = {s.instruction.id: s for s in timeline.spans if s.kind == "comm" and s.paired}
        for s in timeline.spans:
            if s.kind == "host":
                out["exposed_comm"] += s.end - s.start
            if s.kind != "wait":
                continue
            transfer = transfers.get(s.instruction.id)
            if transfer is None:
                out["exposed_comm"] += s.end - s.start
                continue
            on_wire = max(s.start, transfer.start)
            out["bubble"] += max(on_wire - s.start, 0.0)
            out["p2p"] += s.end - on_wire
        stream = max((s.end for s in timeline.spans if s.kind != "comm"), default=self.start)
        out["bubble"] += self.end - stream  # its compute stream done early: idle until the step ends
        out["step"] = self.step_time
        return out


def is_transfer(c) -> bool:
    """A send or receive between the pipeline's stages. A context- or tensor-parallel ring's pass (labelled
    `args["cp"]` or `args["tp"]`) goes to a rank of another pipeline: it is priced on its link, as one rank's
    collectives are."""
    return isinstance(c, Collective) and c.op in ("send", "recv") and "cp" not in c.args and "tp" not in c.args


def pair_transfers(programs: dict, ranks: dict | None = None) -> list:
    """Every send matched with the receive that takes it: between two ranks, the k-th send from a to b feeds
    the k-th receive on b from a (NCCL matches point-to-point calls in order). programs: {stage: program};
    ranks: {stage: its global rank}, the peers the sends and receives name (default: the stages are ranks)."""
    ranks = dict(ranks) if ranks is not None else {stage: stage for stage in programs}
    stage_of = {rank: stage for stage, rank in ranks.items()}
    queues: dict = {}  # (sender rank, receiver rank) -> ([sends], [receives]) in issue order
    for stage, program in programs.items():
        me = ranks[stage]
        for c in program:
            if not is_transfer(c):
                continue
            peer = c.args.get("peer")
            if peer not in stage_of:
                raise ValueError(
                    f"stage {stage!r} (rank {me}) {c.op}s {'to' if c.op == 'send' else 'from'} rank "
                    f"{peer!r}, which has no program here; programs are given for ranks "
                    f"{sorted(stage_of)}: give every rank of the pipeline its program."
                )
            sends, recvs = queues.setdefault((me, peer) if c.op == "send" else (peer, me), ([], []))
            (sends if c.op == "send" else recvs).append(c)
    pairs = []
    for (a, b), (sends, recvs) in sorted(queues.items()):
        if len(sends) != len(recvs):
            raise ValueError(
                f"rank {a} sends {len(sends)} message(s) to rank {b}, which receives {len(recvs)} from "
                f"it: every send needs its receive (a schedule that drops or adds one)."
            )
        for k, (s, r) in enumerate(zip(sends, recvs)):
            if s.size_bytes != r.size_bytes:
                raise ValueError(
                    f"message {k} from rank {a} to rank {b}: {s.size_bytes} bytes sent into a receive "
                    f"of {r.size_bytes}: the two ranks disagree on what their {k}th message is."
                )
            pairs.append(P2P(send=(stage_of[a], s.id), recv=(stage_of[b], r.id)))
    return pairs


class _Stage:
    def __init__(self, program, start: float):
        self.program, self.next, self.clock = list(program), 0, start
        self.spans: list = []
        self.done: dict = {}  # collective id -> when it completes (None: a transfer not yet matched)
        self.links = Links(start)  # when a stage's own links can next start a collective
        self.span_of: dict = {}  # collective id -> its span
        self.hold = (start, None)  # until when its collectives hold the cores (the overlap rule's rule 4)
        self.busy: list = []  # (begin, end) of its collectives in flight (the overlap rule's rule 6)
        self.since = 0.0  # compute seconds since its previous collective (the overlap rule's rule 7)


def schedule_stages(
    programs: dict,
    dependencies,
    compute_time,
    collective_cost,
    *,
    start: float = 0.0,
    overlap: float = 1.0,
    beside: float = 1.0,
    slowdown: float = 0.0,
) -> StagesTimeline:
    """Replay every stage's program together. compute_time(stage, Compute) -> seconds; collective_cost(stage,
    Collective) -> an object with `.seconds`, `.resources` (and optionally `.occupancy`), as for one rank
    (`toolkit.sim.timeline.schedule`); dependencies: `P2P` pairs (anything else is refused; `pair_transfers`
    finds them in recorded programs)."""
    stages = {key: _Stage(program, start) for key, program in programs.items()}
    partner: dict = {}
    for d in dependencies:
        if not isinstance(d, P2P):
            raise TypeError(f"a dependency is a P2P(send=(stage, id), recv=(stage, id)), not {d!r}")
        for end in (d.send, d.recv):
            if end[0] not in stages:
                raise ValueError(f"{d}: stage {end[0]!r} has no program; stages: {sorted(stages, key=str)}")
            if end in partner:
                raise ValueError(f"{d}: collective {end} is already paired with {partner[end]}")
        partner[d.send], partner[d.recv] = d.recv, d.send
    issued: dict = {}  # (stage, id) -> (Collective, issue time), for transfers waiting for their other half
    sends = {d.send for d in dependencies}
    channels: dict = {}  # ("p2p", sender, receiver) -> when its last transfer ends

    def advance(key, st: _Stage) -> bool:
        """Run `key`'s instructions until one must wait for another stage; True if any ran."""
        moved = False
        while st.next < len(st.program):
            instruction = st.program[st.next]
            if isinstance(instruction, Compute):
                st.clock = held(st.spans, st.clock, st.hold, instruction)
                seconds = compute_time(key, instruction)
                end = slowed(st.clock, seconds, st.busy, slowdown)
                st.spans.append(Span("compute", st.clock, end, instruction, contention=end - st.clock - seconds))
                st.since += end - st.clock
                st.clock = end
            elif isinstance(instruction, Collective):
                if instruction.id in st.done:
                    raise ValueError(f"stage {key!r}: collective id {instruction.id} issued twice")
                if (key, instruction.id) in partner:
                    st.done[instruction.id] = None
                    issued[(key, instruction.id)] = (instruction, st.clock)
                    _match(key, instruction.id)
                else:
                    _collective(key, st, instruction)
            elif isinstance(instruction, Wait):
                if instruction.id not in st.done:
                    raise ValueError(f"stage {key!r}: waits on collective {instruction.id} before it was issued")
                if (key, instruction.id) not in sends:  # rule 2: a sender does not wait for its data to be taken
                    if st.done[instruction.id] is None:
                        return moved  # the other half of this transfer has not been issued yet
                    if st.done[instruction.id] > st.clock:
                        st.spans.append(Span("wait", st.clock, st.done[instruction.id], instruction))
                        st.clock = st.done[instruction.id]
            else:
                raise TypeError(f"stage {key!r}: instruction {st.next} is a {type(instruction).__name__}")
            st.next += 1
            moved = True
        return moved

    def _collective(key, st: _Stage, c: Collective) -> None:
        cost = collective_cost(key, c)
        stretch = beside if c.async_op else 1.0
        begin, st.done[c.id] = run_on(st.links, cost, st.clock, stretch, c, st.done, st.span_of, st.busy, st.since)
        st.since = 0.0
        st.busy.append((begin, st.done[c.id]))
        st.spans.append(Span("comm", begin, st.done[c.id], c, issued=st.clock, cost=cost))
        st.span_of[c.id] = st.spans[-1]
        cores = cores_held(cost, overlap)
        if cores > 0:
            st.hold = max(st.hold, (begin + cores, c), key=lambda h: h[0])

    def _match(key, cid) -> None:
        """Both halves issued: run the transfer (rule 1) and complete both."""
        other = partner[(key, cid)]
        if other not in issued:
            return
        send, recv = ((key, cid), other) if (key, cid) in sends else (other, (key, cid))
        (send_c, t_send), (recv_c, t_recv) = issued.pop(send), issued.pop(recv)
        cost = collective_cost(send[0], send_c)
        channel = ("p2p", send[0], recv[0])
        begin = max(t_send, t_recv, channels.get(channel, start))
        end = begin + cost.seconds
        channels[channel] = begin + getattr(cost, "occupancy", cost.seconds)
        for (stage, i), c, t in ((send, send_c, t_send), (recv, recv_c, t_recv)):
            stages[stage].done[i] = end
            stages[stage].busy.append((begin, end))
            stages[stage].spans.append(Span("comm", begin, end, c, issued=t, cost=cost, paired=True))

    while any(st.next < len(st.program) for st in stages.values()):
        if not any([advance(key, st) for key, st in stages.items()]):
            blocked = "; ".join(
                f"stage {key!r} at instruction {st.next}, {st.program[st.next]!r}"
                for key, st in stages.items()
                if st.next < len(st.program)
            )
            raise ValueError(
                f"the stages' programs deadlock: every stage with work left waits for a transfer whose "
                f"other half is issued only after it: {blocked}"
            )
    unmatched = sorted(issued, key=str)
    if unmatched:
        raise ValueError(f"transfers issued on one side only: {unmatched} (their partners were never issued)")
    out = StagesTimeline(start=start)
    for key, st in stages.items():
        st.clock = held(st.spans, st.clock, st.hold)
        ends = [st.clock] + [t for t in st.done.values() if t is not None]
        out.stages[key] = Timeline(st.spans, start, max(ends))
    return out
