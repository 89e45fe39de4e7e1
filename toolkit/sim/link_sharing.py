"""Links that share their bandwidth among the communicators on them (`Cluster.links_share`), where they take turns.

NCCL runs each communicator's collectives on a stream of its own, in the order they were issued, so a
tensor-parallel all-reduce issued while a data-parallel all-gather crosses the same link does not wait for it:
both run, each at a share of the link. Two collectives of one communicator do not: the second waits for the first
(FSDP's all-gather and reduce-scatter on one process group; a pipelined MoE layer's chunked all-to-alls). Here each
link divides its rate equally among the communicators with a collective on it (processor sharing), and each
communicator runs its own in issue order; a communicator is a group of ranks (one per rank set, as a process group
is). What a collective needs of a link is its bytes' time there at the full rate (`CollectiveCost.occupancy_on`);
the rest of its time (latency beyond that) it adds once, not holding the link meanwhile.

A newcomer delays the collectives in flight or queued, whose (begin, end) were handed out before: `run` gives the
newcomer's and `moved()` the others' new ones, which the replay updates (`timeline.run_on`). None of their waits
has been passed yet: a rank's clock is at the newcomer's issue, and each of them ends after it.

    links = SharedLinks(start); begin, end = links.run(cost, ready, key=collective_id, group=ranks); links.moved()
"""

from __future__ import annotations

_DONE = 1e-15  # seconds of work below which a collective has finished on a link


def held_on(cost):
    """link -> the seconds a collective needs of that link: its `occupancy_on(link)`, else its `occupancy`, else
    its `seconds` (a cost that does not say)."""
    return getattr(cost, "occupancy_on", lambda link: getattr(cost, "occupancy", cost.seconds))


class SharedLinks:
    """Each link's communicators, each with its collectives in issue order and the work (seconds at the link's full
    rate) each has left there; every communicator with work progresses at 1/n of the rate while n have work."""

    def __init__(self, start: float):
        self.start = start
        self.jobs: dict = {}  # key -> [fixed seconds, {link: [start there, finish there]}]
        self.links: dict = {}  # link -> [time of the last update, {group: [[key, work left], ...]}]
        self._moved: dict = {}

    def _advance(self, link: str, t: float) -> None:
        """The link's communicators progressed to time `t`, each at 1/n of the rate while n have work."""
        state = self.links.setdefault(link, [self.start, {}])
        queues = state[1]
        while queues and state[0] < t:
            n, smallest = len(queues), min(sum(w for _, w in q) for q in queues.values())
            step, then = (smallest, state[0] + smallest * n) if state[0] + smallest * n < t else ((t - state[0]) / n, t)
            for group, queue in list(queues.items()):
                left = step
                while queue and queue[0][1] <= left + _DONE:
                    left -= queue.pop(0)[1]
                if queue:
                    queue[0][1] -= left
                else:
                    del queues[group]
            state[0] = then
        state[0] = max(state[0], t)

    def _project(self, link: str) -> None:
        """When each collective on the link starts and finishes there if no other arrives. Every communicator with
        work does the same work per second, so all have done `depth` seconds of their own work at one time, `at`."""
        now, queues = self.links[link]
        totals = sorted(sum(w for _, w in q) for q in queues.values())

        def at(depth: float) -> float:
            t, done = now, 0.0
            for i, total in enumerate(totals):
                if depth <= total:
                    break
                t, done = t + (total - done) * (len(totals) - i), total
            return t + (depth - done) * (len(totals) - i)

        for queue in queues.values():
            depth = 0.0
            for position, (key, work) in enumerate(queue):
                there = self.jobs[key][1][link]
                if position:  # queued behind its communicator's earlier collectives
                    there[0] = at(depth)
                depth += work
                there[1] = at(depth)

    def _span(self, key) -> tuple[float, float]:
        fixed, there = self.jobs[key]
        return max(s for s, _ in there.values()), max(f for _, f in there.values()) + fixed

    def run(self, cost, ready: float, stretch: float = 1.0, key=None, group=None) -> tuple[float, float]:
        """(begin, end) of a collective issued at `ready` (`stretch`: timeline rule 5) by communicator `group` (its
        own, where None); `key` names it in `moved()`."""
        held = held_on(cost)
        works = {link: held(link) * stretch for link in cost.resources}
        total = cost.seconds * stretch
        if not works:
            return ready, ready + total
        key = key if key is not None else object()
        group = ("alone", key) if group is None else tuple(group)  # a group of ranks, however it was given
        self.jobs[key] = [total - max(works.values()), {}]
        touched = set()
        for link, work in works.items():
            self._advance(link, ready)
            queues = self.links[link][1]
            self.jobs[key][1][link] = [ready, ready]
            queues.setdefault(group, []).append([key, work])
            self._project(link)
            touched |= {k for queue in queues.values() for k, _ in queue}
        for k in touched - {key}:
            self._moved[k] = self._span(k)
        return self._span(key)

    def moved(self) -> dict:
        """{key: its new (begin, end)} for the collectives in flight or queued that the last arrivals delayed."""
        out, self._moved = self._moved, {}
        return out
