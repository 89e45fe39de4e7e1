"""The overlap rule: a program, replayed on a compute stream and the links, becomes a timeline.

The rule, in the order the strategy issued its work (`toolkit.sim.program`):

1. `Compute` runs on the compute stream, after whatever ran there before it.
2. A `Collective` is issued when the compute before it has been issued; its data is ready when that
   compute has finished, so it starts then, or when the links it needs are free of earlier
   collectives, whichever is later, and runs for the time the link model gives (`collective_time`).
   Collectives on different links (NVLink inside a node, the network between nodes) run side by side;
   on the same link they take turns, in issue order, each holding it for its bytes' time on that link
   (a ring across nodes that the network bounds holds NVLink for less than its whole time). Where the
   links share (`Cluster.links_share`, the GPU presets: NCCL's communicators on streams of their own),
   the communicators on a link split its rate, each running its own collectives in issue order
   (`link_sharing`).
3. A `Wait` stalls the compute stream until that collective has finished. A synchronous collective is
   a Collective followed at once by its Wait, so it always stalls; an asynchronous one stalls only
   if the compute issued after it is shorter than it.
4. Where the links are not hardware of their own (`overlap` < 1: on a CPU, gloo's threads copy and
   reduce on the cores the ranks compute on), a collective also holds the compute stream for the
   part of its time that cannot hide, (1 - overlap) x its time, from when it begins: the next compute
   waits for the latest such hold (a "host" span, counted as exposed communication), but the next
   collective may be issued meanwhile (issuing one is queueing it for gloo's threads), and so may the views
   between them (a segment without kernels: microseconds of the host's dispatch, not work for the cores).
   With overlap 0 an asynchronous collective costs what a synchronous one does; a synchronous one costs the same
   whatever `overlap` is. A cost may say its hold itself (`CollectiveCost.cores`): an emulated link's
   call holds the cores for the real loopback call beneath it, its sleep for the rest hides whole.
5. Optionally (`beside` > 1, `Cluster.beside_compute`), an asynchronous collective takes `beside` times
   its own time in flight, as where the cores that run it are also computing; what queues behind it
   on its link waits that much longer. A synchronous collective has nothing beside it. 1 on every
   preset: the calibration measures it on a CPU but does not charge it (too unsteady: docs/benchmarks.md).
6. Where collectives share the SMs with compute (a GPU: NCCL's kernels take some of the SMs and the memory
   bandwidth), compute runs `slowdown` longer while one of this rank's collectives is in flight
   (`published_collectives.OVERLAP_SLOWDOWN`, measured; 0 on a CPU and on user-defined clusters). The extra time is the
   compute span's `contention`.
7. A collective starts when its group's last rank arrives. Where ranks share cores, the same work between two calls
   ends at different moments on each: a cost whose time runs from that last issue (`CollectiveCost.from_last_issue`,
   an emulated link's) ends no earlier than the issue, plus how late the last rank came after this one's compute
   since its previous collective (`Cluster.late_peers`, measured), plus that time. Nowhere else: a loopback
   collective's measured cost has the ranks' lateness in it (charged again beyond the calibration's gaps, it counted
   some twice: docs/differences.md, note 27), and the GPU presets state none.

The step ends when the compute stream is done and no collective is still in flight. So the time of a
step splits three ways: compute; exposed communication (the compute stream waiting); and overlapped
communication (collectives in flight while computing), which costs nothing. Bucketed DDP, FSDP's
prefetch and ZeRO-3's buckets show their worth here because they issue collectives early.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .link_sharing import SharedLinks, held_on
from .program import Collective, Compute, Wait


@dataclass
class Span:
    kind: str  # "compute", "comm", "wait" (the compute stream stalled) or "host" (it ran a collective)
    start: float
    end: float
    instruction: object  # the Compute, Collective or Wait it came from
    issued: float = 0.0  # comm: when the strategy issued it (start - issued = time queued for a link)
    cost: object = None  # comm: its CollectiveCost
    paired: bool = False  # comm: one half of a point-to-point transfer between stages (`stage_timeline`)
    contention: float = 0.0  # compute: the seconds it ran longer beside collectives in flight (rule 6)


@dataclass
class Timeline:
    """One step's modelled spans, and how its time splits."""

    spans: list = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def step_time(self) -> float:
        return self.end - self.start

    @property
    def compute(self) -> float:
        return sum(s.end - s.start for s in self.spans if s.kind == "compute")

    @property
    def exposed_comm(self) -> float:
        """Time the compute stream had nothing to do but wait for communication (trailing transfers included)."""
        return self.step_time - self.compute

    @property
    def comm(self) -> float:
        """Time with at least one collective in flight."""
        return _union_length((s.start, s.end) for s in self.spans if s.kind == "comm")

    @property
    def overlapped_comm(self) -> float:
        return max(self.comm - self.exposed_comm, 0.0)

    def breakdown(self) -> dict:
        return {
            "compute": self.compute,
            "exposed_comm": self.exposed_comm,
            "overlapped_comm": self.overlapped_comm,
            "step": self.step_time,
        }


def cores_held(cost, overlap: float) -> float:
    """Seconds a collective holds the cores (rule 4): what its cost says (`CollectiveCost.cores`: an emulated
    link's real loopback call beneath its sleep), else the part of it that cannot hide, (1 - overlap) x its time."""
    cores = getattr(cost, "cores", None)
    return (1 - overlap) * cost.seconds if cores is None else cores


def held(spans: list, clock: float, hold: tuple, segment: Compute | None = None) -> float:
    """Where the compute stream is once the collectives' hold on the cores (rule 4) is over: a "host" span
    from `clock` to the hold's end (`hold`: (end, the collective that holds them)) where it stalls. A `segment`
    of views alone (`Compute.views_only`) does not wait for it."""
    end, collective = hold
    if end <= clock or (segment is not None and segment.views_only):
        return clock
    spans.append(Span("host", clock, end, collective))
    return end


def _union_length(intervals) -> float:
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def slowed(start: float, seconds: float, busy: list, slowdown: float) -> float:
    """When `seconds` of compute begun at `start` ends, running (1 + slowdown) times longer wherever one of the
    `busy` intervals (begin, end) covers it (rule 6). `busy` is pruned of intervals over before `start`."""
    busy[:] = [(b, e) for b, e in busy if e > start]
    if slowdown <= 0 or seconds <= 0 or not busy:
        return start + seconds
    t, left = start, seconds
    merged: list = []
    for b, e in sorted(busy):
        if merged and b <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((b, e))
    for b, e in merged:
        if b > t:
            if b - t >= left:
                return t + left
            left -= b - t
            t = b
        done = (e - t) / (1 + slowdown)  # the work that fits in the rest of this busy stretch
        if done >= left:
            return t + left * (1 + slowdown)
        left -= done
        t = e
    return t + left


class Links:
    """When each of a rank's links can next start a collective (rules 2 and 5): a link runs `cost.lanes`
    collectives at once (1 where the cost does not say), each for its `occupancy_on(link)` (its `occupancy`, or
    its `seconds`, where the cost does not say); where the cost says its links share (`cost.shares`, from
    `Cluster.links_share`), the communicators on a link share its rate, each running its own in turn
    (`link_sharing`)."""

    def __init__(self, start: float):
        self.start, self.lanes = start, {}  # link -> the ends of the collectives on its lanes
        self.shared = SharedLinks(start)

    def run(self, cost, ready: float, stretch: float = 1.0, key=None, group=None) -> tuple[float, float]:
        """(begin, end) of a collective whose data is ready at `ready`; its links are held from `begin`. `key`
        names it among the spans a later collective moves on shared links (`moved`); `group`: its communicator."""
        if getattr(cost, "shares", False):
            return self.shared.run(cost, ready, stretch, key, group)
        lanes = getattr(cost, "lanes", 1)
        ends = [self.lanes.setdefault(link, []) for link in cost.resources]
        begin = max([ready] + [min(e) if len(e) >= lanes else self.start for e in ends])
        held = held_on(cost)
        for link, e in zip(cost.resources, ends):
            if len(e) >= lanes:
                e.remove(min(e))
            e.append(begin + held(link) * stretch)
        return begin, begin + cost.seconds * stretch

    def moved(self) -> dict:
        """{key: new (begin, end)} of collectives in flight or queued that the last one delayed, on links that share."""
        return self.shared.moved()


def run_on(
    links: Links, cost, ready: float, stretch: float, collective, done: dict, span_of: dict, busy: list, since=0.0
):
    """(begin, end) of `collective` on `links`, issued at `ready` after `since` seconds of compute since this rank's
    previous collective (rule 7); the ones it delays (links that share) moved in `done` (id -> end), their spans
    (`span_of`: id -> Span) and the in-flight intervals of rule 6 (`busy`)."""
    begin, end = links.run(cost, ready, stretch, collective.id, collective.group)
    late = getattr(cost, "end_with_late_peers", None)
    if late is not None:
        end = late(ready, since, end)
    for k, (new_begin, new_end) in links.moved().items():
        span = span_of.get(k)
        if span is None or done.get(k) is None or (new_begin, new_end) == (span.start, span.end):
            continue
        busy[:] = [(new_begin, new_end) if (b, e) == (span.start, span.end) else (b, e) for b, e in busy]
        span.start, span.end = new_begin, new_end
        done[k] = new_end
    return begin, end


def schedule(
    program,
    compute_time,
    collective_cost,
    start: float = 0.0,
    overlap: float = 1.0,
    beside: float = 1.0,
    slowdown: float = 0.0,
) -> Timeline:
    """Replay `program` from time `start`: compute_time(Compute) -> seconds, collective_cost(Collective) ->
    an object with `.seconds`, `.resources` (the links it occupies) and optionally `.occupancy` (how long it
    holds them, `.seconds` if absent: `toolkit.sim.collective_time`); overlap: rule 4; beside: rule 5;
    slowdown: rule 6."""
    clock = start  # where the compute stream is
    hold = (start, None)  # until when this rank's collectives hold the cores (rule 4), and which one
    links = Links(start)
    done: dict[int, float] = {}  # collective id -> when it ends
    span_of: dict = {}  # collective id -> its span
    busy: list = []  # (begin, end) of collectives in flight, for rule 6
    since = 0.0  # compute seconds since this rank's previous collective, for rule 7
    spans = []
    for n, instruction in enumerate(program):
        if isinstance(instruction, Compute):
            clock = held(spans, clock, hold, instruction)
            seconds = compute_time(instruction)
            end = slowed(clock, seconds, busy, slowdown)
            spans.append(Span("compute", clock, end, instruction, contention=end - clock - seconds))
            since += end - clock
            clock = end
        elif isinstance(instruction, Collective):
            if instruction.id in done:
                raise ValueError(f"instruction {n}: collective id {instruction.id} issued twice")
            cost = collective_cost(instruction)
            stretch = beside if instruction.async_op else 1.0
            begin, end = run_on(links, cost, clock, stretch, instruction, done, span_of, busy, since)
            since = 0.0
            done[instruction.id] = end
            busy.append((begin, end))
            spans.append(Span("comm", begin, end, instruction, issued=clock, cost=cost))
            span_of[instruction.id] = spans[-1]
            cores = cores_held(cost, overlap)
            if cores > 0:
                hold = max(hold, (begin + cores, instruction), key=lambda h: h[0])
        elif isinstance(instruction, Wait):
            if instruction.id not in done:
                raise ValueError(f"instruction {n}: waits on collective {instruction.id} before it was issued")
            if done[instruction.id] > clock:
                spans.append(Span("wait", clock, done[instruction.id], instruction))
                clock = done[instruction.id]
        else:
            raise TypeError(
                f"instruction {n} is a {type(instruction).__name__}; a program holds Compute, "
                f"Collective and Wait (toolkit.sim.program)."
            )
    clock = held(spans, clock, hold)
    return Timeline(spans, start, max([clock] + list(done.values())))
