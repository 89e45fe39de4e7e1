"""This machine's collectives, measured as a training step pays them (every rank at once, gloo on loopback).

- A collective's cost inside a step: each one is called through the collectives door at several sizes
  with compute between the calls (a spread of gaps, as a step has), with no barrier before each; what
  the calls add to the loop's time, divided by the calls, is the mean cost of one (the door's host
  work, the handover to gloo's thread and back, the ranks' skew and the slow tail are all in it: a step
  pays every call's tail, so the mean, not the median of back-to-back calls).
- How much of a collective hides behind compute (`Cluster.overlap`): the same loop with the all-gather
  issued asynchronously before the compute and waited after it; the time it saves over the
  synchronous loop, over the time it could save (the shorter of the two). On a GPU the links and the
  streams are separate hardware (1.0); here gloo's threads copy on the cores the ranks compute on.
- How many collectives run at once (`Cluster.collective_lanes`): gloo's worker threads, read from the group.
- How late the last rank reaches a collective (`Cluster.late_peers`): `calibrate_late`.
- A collective in flight beside compute and another collective (reported; `Cluster.beside_compute` charges
  it only where a user asks, as it is too unsteady on a shared CPU to charge by default): what ZeRO-3
  and FSDP do in backward. An asynchronous reduce-scatter is issued, compute runs, and the next layer's
  all-gather is called while it may still be in flight; the reduce-scatter's completion is polled
  between the compute's matmuls. Its time in flight over its cost alone (the loop above) says how much
  longer a collective takes when the cores it runs on are computing too.
"""

from __future__ import annotations

import statistics
import time

from .calibrate_late import late_peers, matmuls

SIZES = (4 * 1024, 64 * 1024, 512 * 1024, 2 * 1024 * 1024)
GAPS = (3, 10, 30)  # 128x128 matmuls between two calls, in turn (about 0.1, 0.3 and 1 ms on 2 cores)
CALLS, ROUNDS = 18, 3  # calls per timed loop; loops with and without the calls, interleaved
OVERLAP_SIZES, OVERLAP_GAPS = (512 * 1024, 2 * 1024 * 1024), (50,)  # compute about as long as the call
OVERLAP_ROUNDS = 5  # a difference of two noisy loops: on 2 cores it still spreads 0-0.5 between calibrations
BESIDE_SIZE, BESIDE_GAP = 512 * 1024, 50  # one layer's gradients of the accuracy benchmark's model, order of


def _loop(call, reset=lambda: None, gaps=GAPS) -> float:
    """Seconds for CALLS rounds of (compute, then `call`), all ranks starting together."""
    import torch.distributed as dist

    a, b = matmuls()
    dist.barrier()
    start = time.perf_counter()
    for i in range(CALLS):
        reset()
        for _ in range(gaps[i % len(gaps)]):
            a @ b
        call()
    return time.perf_counter() - start


def in_a_step(prepared) -> float:
    """The mean seconds one call adds to a loop that computes between calls (every rank: the slowest one's)."""
    import torch
    import torch.distributed as dist

    reset, call, _ = prepared
    _loop(call, reset)  # warm-up
    with_calls, without = [], []
    for _ in range(ROUNDS):
        with_calls.append(_loop(call, reset))
        without.append(_loop(lambda: None, reset))
    added = torch.tensor([max(statistics.median(with_calls) - statistics.median(without), 0.0) / CALLS])
    dist.all_reduce(added, op=dist.ReduceOp.MAX)
    return added.item()


def overlap(sizes=OVERLAP_SIZES) -> float:
    """The fraction of an asynchronous all-gather that hides behind the compute issued after it, pooled over
    `sizes`: (synchronous loop - asynchronous loop) / the shorter of (its calls, its compute), in [0, 1]."""
    import torch
    import torch.distributed as dist

    from ..comm import collectives as door
    from ..comm.measure import _numel_for

    saved = possible = 0.0
    for size in sizes:
        n = dist.get_world_size()
        out = torch.empty(_numel_for(size, n, 4))
        mine = out[: out.numel() // n].clone()
        pending = []

        def issue(pending=pending, out=out, mine=mine):  # before the next round's compute: waited there, after it
            if pending:
                pending.pop().wait()
            pending.append(door.all_gather(out, mine, async_op=True))

        def synchronous(out=out, mine=mine):
            door.all_gather(out, mine)

        _loop(synchronous, gaps=OVERLAP_GAPS)
        times = {"sync": [], "async": [], "none": []}
        for _ in range(OVERLAP_ROUNDS):
            times["sync"].append(_loop(synchronous, gaps=OVERLAP_GAPS))
            times["async"].append(_loop(lambda: None, issue, OVERLAP_GAPS) + _drain(pending))
            times["none"].append(_loop(lambda: None, gaps=OVERLAP_GAPS))
        sync, overlapped, compute = (statistics.median(times[k]) for k in ("sync", "async", "none"))
        saved += sync - overlapped
        possible += min(sync - compute, compute)
    both = torch.tensor([saved, possible])
    dist.all_reduce(both)
    return min(max(both[0].item() / both[1].item(), 0.0), 1.0) if both[1] > 0 else 1.0


def _drain(pending) -> float:
    start = time.perf_counter()
    while pending:
        pending.pop().wait()
    return time.perf_counter() - start


def beside_compute(alone_s: float, size: int = BESIDE_SIZE, gap: int = BESIDE_GAP) -> dict:
    """An asynchronous reduce-scatter in flight beside compute, then an all-gather called behind it (ZeRO-3's
    and FSDP's backward): the reduce-scatter's time from issue to completion (polled between matmuls; the
    slowest rank's median) over `alone_s`, its cost in a step when nothing runs beside it."""
    import torch
    import torch.distributed as dist

    from ..comm import collectives as door
    from ..comm.measure import _numel_for

    n = dist.get_world_size()
    numel = _numel_for(size, n, 4)
    grads, shard = torch.randn(numel), torch.empty(numel // n)
    out, mine = torch.empty(numel), torch.randn(numel // n)
    a, b = matmuls()
    in_flight, gathers = [], []
    for round_ in range(CALLS + 2):
        dist.barrier()
        start = time.perf_counter()
        work = door.reduce_scatter(shard, grads, async_op=True)
        done = None
        for _ in range(gap):
            a @ b
            if done is None and work.is_completed():
                done = time.perf_counter()
        called = time.perf_counter()
        door.all_gather(out, mine)
        gathered = time.perf_counter()
        work.wait()
        done = done or time.perf_counter()
        if round_ >= 2:  # two rounds of warm-up
            in_flight.append(done - start)
            gathers.append(gathered - called)
    mine_ = torch.tensor([statistics.median(in_flight), statistics.median(gathers)])
    dist.all_reduce(mine_, op=dist.ReduceOp.MAX)
    rs, ag = mine_.tolist()
    return {
        "size_bytes": numel * 4,
        "reduce_scatter_in_flight_s": rs,
        "reduce_scatter_alone_s": alone_s,
        "all_gather_behind_s": ag,
        "stretch": max(rs / alone_s, 1.0) if alone_s > 0 else 1.0,
    }


def lanes(backend=None) -> int:
    """How many collectives a gloo backend (the default group's if None) runs at once: its worker threads
    (`ProcessGroupGloo`'s Options.threads, 2 unless set), read from the live backend; 1 where it says nothing."""
    import torch
    import torch.distributed as dist

    backend = backend or dist.group.WORLD._get_backend(torch.device("cpu"))
    return int(getattr(getattr(backend, "options", None), "_threads", 1) or 1)


def measure_links(ops, sizes=SIZES) -> dict:
    """On every rank: each op's cost in a step at each size, the overlap fraction, and a reduce-scatter beside
    compute. Records are rank 0's view (every value is already the slowest rank's)."""
    import torch
    import torch.distributed as dist

    from ..comm.measure import _numel_for, _prepare
    from ..trace.events import recorder

    recorder.enabled = False  # bookkeeping: the calibration leaves no trace
    records, n = [], dist.get_world_size()
    for k, group in [(n, None), *subgroups(n)]:
        for op in ops:
            for size in sizes:
                numel = _numel_for(size, k, 4)
                prepared = _prepare(op, numel, torch.float32, torch.device("cpu"), seed=len(records), group=group)
                seconds = in_a_step(prepared)
                records.append(dict(op=op, impl="backend", size_bytes=numel * 4, world_size=k, seconds=seconds))
    alone = in_a_step(
        _prepare("reduce_scatter", _numel_for(BESIDE_SIZE, n, 4), torch.float32, torch.device("cpu"), seed=99)
    )
    return {
        "records": records,
        "overlap": overlap(),
        "beside_compute": beside_compute(alone),
        "lanes": lanes(),
        "emulator_bookings": emulator_bookings() if n > 1 else 0.0,
        "emulator_marks": emulator_marks() if n > 1 else 0.0,
        "late_peers": late_peers() if n > 1 else [],  # `calibrate_late`
    }


def subgroups(n: int) -> list:
    """(k, this rank's group) for every group size 2 <= k < n that divides n: the ranks in blocks of k, every block
    at once, as a layout's tensor-, pipeline- or data-parallel groups run. A collective of k ranks while the others
    run theirs costs more than the world's fit gives k ranks (the cores are shared by every group: at 4 ranks on 2
    cores, an all-reduce in pairs measured 1.2x-2.0x the world's alpha-beta at 2 ranks); each size is measured."""
    import torch.distributed as dist

    me, found = dist.get_rank(), []
    for k in range(2, n):
        if n % k == 0:
            blocks = [dist.new_group(list(range(start, start + k))) for start in range(0, n, k)]  # every rank, each
            found.append((k, blocks[me // k]))
    return found


BOOKINGS = 20  # all-to-alls booked in the emulated link's bookkeeping measurement


def emulator_bookings() -> float:
    """Seconds of host work the emulated link's bookkeeping adds to one all-to-all at issue, every rank at once
    (`toolkit.comm.cost.schedule_all_to_all` on the job's store): a reservation of each peer's receiving side and a
    note of the delivery, round trips to the store that every rank makes at the same moments. The loopback call
    and the sleep are priced apart; this is what the call's issue costs the host before either."""
    import torch.distributed as dist

    from ..comm.store_ledger import StoreLedger

    ledger, me, n = StoreLedger(dist.distributed_c10d._get_default_store()), dist.get_rank(), dist.get_world_size()
    times = []
    for call in range(BOOKINGS):
        dist.barrier()
        start = time.perf_counter()
        for peer in range(n):
            if peer != me:
                taken = ledger.reserve(("calibration", peer, "recv"), start, 0.0)
                ledger.note(("calibration", call, peer), taken)
        times.append(time.perf_counter() - start)
        dist.barrier()
        ledger.take(("calibration", call, me))
    return statistics.median(times)


def emulator_marks() -> float:
    """Seconds of host work the emulated link's issue marks add to one ring collective or barrier, every rank at once
    (`toolkit.comm.deadlines`): this rank's mark in the job's store at issue, and its peers' read once the call is
    done, through the code a call runs (`issue_mark`, `Together`)."""
    import torch.distributed as dist

    from ..comm.deadlines import Together, issue_mark
    from ..comm.store_ledger import StoreLedger

    ledger, me, n = StoreLedger(dist.distributed_c10d._get_default_store()), dist.get_rank(), dist.get_world_size()
    peers, times = [r for r in range(n) if r != me], []
    for call in range(1, BOOKINGS + 1):
        dist.barrier()
        start = time.perf_counter()
        issue_mark(ledger, "calibration", call, me, start)
        marked = time.perf_counter()
        dist.barrier()  # the real call's place: once it is over, every peer has marked
        read = time.perf_counter()
        Together(0.0, ledger, "calibration", call, peers, start, 0.0).at()
        times.append(marked - start + time.perf_counter() - read)
    return statistics.median(times)
