"""Links that share their bandwidth among the collectives on them (`Cluster.links_share`), where they take turns.

NCCL runs each communicator's collectives on a stream of its own, so a tensor-parallel all-reduce issued while a
data-parallel all-gather crosses the same link does not wait for it: both run, each at a share of the link. Here
each link divides its rate equally among the collectives on it (processor sharing): a collective starts when it is
issued, and each one in flight slows while it shares. What a collective needs of a link is its bytes' time there at
the full rate (`CollectiveCost.occupancy_on`); the rest of its time (latency beyond that) it adds once.

A newcomer delays the collectives in flight, whose ends were handed out before: `run` gives the newcomer's
(begin, end) and `moved()` the new ends of the others, which the replay updates (`timeline.run_on`). None of their
waits has been passed yet: a rank's clock is at the newcomer's issue, and each of them ends after it.

    links = SharedLinks(start); begin, end = links.run(cost, ready, key=collective_id); links.moved()
"""

from __future__ import annotations


class SharedLinks:
    """Each link's collectives in flight and the work (seconds at the link's full rate) each has left there."""

    def __init__(self, start: float):
        self.start = start
        self.jobs: dict = {}  # key -> [fixed seconds, {link: finish}]
        self.links: dict = {}  # link -> [time of the last update, {key: work left}]
        self._moved: dict = {}

    def _advance(self, link: str, t: float) -> None:
        """The link's collectives progressed to time `t`, each at 1/n of the rate while n share it."""
        state = self.links.setdefault(link, [self.start, {}])
        now, left = state
        while left and now < t:
            n, smallest = len(left), min(left.values())
            if now + smallest * n <= t:
                now += smallest * n
                for k in list(left):
                    left[k] -= smallest
                    if left[k] <= 1e-15:
                        del left[k]
            else:
                for k in left:
                    left[k] -= (t - now) / n
                now = t
        state[0] = max(now, t)

    def _project(self, link: str) -> None:
        """When each collective on the link finishes there if no other arrives: the least work first, n at a time."""
        now, left = self.links[link]
        order = sorted(left.items(), key=lambda kv: kv[1])
        t, done, n = now, 0.0, len(order)
        for i, (k, r) in enumerate(order):
            t += (r - done) * (n - i)
            done = r
            self.jobs[k][1][link] = t

    def run(self, cost, ready: float, stretch: float = 1.0, key=None) -> tuple[float, float]:
        """(begin, end) of a collective issued at `ready` (`stretch`: timeline rule 5); `key` names it in `moved()`."""
        held = getattr(cost, "occupancy_on", lambda link: getattr(cost, "occupancy", cost.seconds))
        works = {link: held(link) * stretch for link in cost.resources}
        total = cost.seconds * stretch
        fixed = total - max(works.values(), default=0.0)
        key = key if key is not None else object()
        self.jobs[key] = [fixed, {}]
        touched = set()
        for link, work in works.items():
            self._advance(link, ready)
            self.links[link][1][key] = work
            self._project(link)
            touched |= set(self.links[link][1])
        for k in touched - {key}:
            fixed_k, finishes = self.jobs[k]
            self._moved[k] = max(finishes.values()) + fixed_k
        finishes = self.jobs[key][1]
        end = (max(finishes.values()) if finishes else ready) + fixed
        return ready, end

    def moved(self) -> dict:
        """{key: its new end} for the collectives in flight that the last arrivals delayed (once each)."""
        out, self._moved = self._moved, {}
        return out
