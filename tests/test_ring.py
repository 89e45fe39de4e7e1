"""Tests for toolkit/comm/ring.py and toolkit/comm/alltoall.py on real gloo ranks.

Each hand-written collective must give the backend's answer: bitwise for MAX/MIN and integers,
allclose for sums and products of floats (the ring adds in another order). One launch per world
size runs every case and returns (hand-written, backend) pairs; the tests compare them here.
"""

import itertools

import pytest
import torch

import toolkit
from toolkit.comm.alltoall import pairwise_schedule
from toolkit.runtime.launch import RankError

WORLD_SIZES = (1, 2, 3, 4)
SIZES = (1, 5, 7, 129, 4099)
DTYPES = (torch.float32, torch.float64, torch.int64)
OPS = ("SUM", "MAX", "MIN", "PRODUCT")


def split_matrix(n):
    """rows[i][j]: rows rank i sends to rank j in the uneven all-to-all; zeros included."""
    return [[(3 * i + 5 * j + 1) % 4 for j in range(n)] for i in range(n)]


def rank_data(rank, numel, dtype, op, salt=0):
    """Deterministic per-rank data; products stay small so integers do not overflow."""
    g = torch.Generator().manual_seed(1000 * rank + 7 * numel + salt)
    if op == "PRODUCT":
        values = torch.randint(1, 3, (numel,), generator=g) * (1 - 2 * torch.randint(0, 2, (numel,), generator=g))
        return values.to(dtype) if not dtype.is_floating_point else (values * 0.75).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)


def run_every_case(n):
    """The body of every rank: each case yields {key: (hand_written, backend)}."""
    import torch.distributed as dist

    from toolkit.comm import alltoall, backend, ring
    from toolkit.trace.events import recorder

    rank, out = dist.get_rank(), {}
    for dtype, numel, op_name in itertools.product(DTYPES, SIZES, OPS):
        op = getattr(dist.ReduceOp, op_name)
        x = rank_data(rank, numel, dtype, op_name)
        mine, theirs = x.clone(), x.clone()
        ring.all_reduce(mine, op, None, False)
        backend.all_reduce(theirs, op, None, False)
        out["all_reduce", dtype, numel, op_name] = (mine, theirs)

        y = rank_data(rank, n * numel, dtype, op_name, salt=1)
        y_before = y.clone()
        mine, theirs = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        ring.reduce_scatter(mine, y, op, None, False)
        backend.reduce_scatter(theirs, y, op, None, False)
        out["reduce_scatter", dtype, numel, op_name] = (mine, theirs)
        out["reduce_scatter keeps its input", dtype, numel, op_name] = (y, y_before)

    for dtype, rows in itertools.product(DTYPES, (1, 5, 43)):
        z = rank_data(rank, rows * 3, dtype, "SUM").view(rows, 3)
        mine, theirs = torch.empty(n * rows, 3, dtype=dtype), torch.empty(n * rows, 3, dtype=dtype)
        ring.all_gather(mine, z, None, False)
        backend.all_gather(theirs, z, None, False)
        out["all_gather", dtype, rows] = (mine, theirs)

    # all-to-all: uneven splits with empty blocks, and equal splits given as None
    rows = split_matrix(n)
    send_rows, recv_rows = rows[rank], [rows[i][rank] for i in range(n)]
    for dtype in DTYPES:
        a = rank_data(rank, sum(send_rows) * 2, dtype, "SUM").view(-1, 2)
        mine, theirs = torch.full((sum(recv_rows), 2), -7, dtype=dtype), torch.empty(sum(recv_rows), 2, dtype=dtype)
        alltoall.all_to_all(mine, a, recv_rows, send_rows, None, False)
        backend.all_to_all(theirs, a, recv_rows, send_rows, None, False)
        out["all_to_all uneven", dtype] = (mine, theirs)
    a = rank_data(rank, n * 4 * 3, torch.float32, "SUM").view(n * 4, 3)
    mine, theirs = torch.empty_like(a), torch.empty_like(a)
    alltoall.all_to_all(mine, a, None, None, None, False)
    backend.all_to_all(theirs, a, None, None, None, False)
    out["all_to_all equal",] = (mine, theirs)

    # the ring talks only to its neighbours and sends 2 * numel - |chunk r| - |chunk r+1| elements
    sent, received, real_batch = [], [], dist.batch_isend_irecv

    def counting_batch(ops):
        for p2p in ops:
            (sent if p2p.op is dist.isend else received).append((p2p.peer, p2p.tensor.numel()))
        return real_batch(ops)

    dist.batch_isend_irecv = counting_batch
    try:
        events_before = len(recorder.events)
        t = rank_data(rank, 1001, torch.float32, "SUM")
        ring.all_reduce(t, dist.ReduceOp.SUM, None, False)
        out["ring events"] = len(recorder.events) - events_before
    finally:
        dist.batch_isend_irecv = real_batch
    chunk = [c.numel() for c in torch.arange(1001).tensor_split(n)]
    out["traffic"] = {
        "sent_to": sorted({p for p, _ in sent}),
        "received_from": sorted({p for p, _ in received}),
        "elements_sent": sum(k for _, k in sent),
        "expected_sent": 0 if n == 1 else 2 * 1001 - chunk[rank] - chunk[(rank + 1) % n],
        "right": (rank + 1) % n,
        "left": (rank - 1) % n,
    }

    # subgroups: rings of global ranks {0, 2} and {1, 3}, and {0, 1, 3} (neighbours are not rank +- 1)
    if n == 4:
        pairs, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        trio = dist.new_group([0, 1, 3])
        for name, group, numel in (("pair", pairs, 7), ("trio", trio if rank != 2 else None, 129)):
            if group is None:
                continue
            x = rank_data(rank, numel, torch.float32, "SUM")
            mine, theirs = x.clone(), x.clone()
            ring.all_reduce(mine, dist.ReduceOp.SUM, group, False)
            backend.all_reduce(theirs, dist.ReduceOp.SUM, group, False)
            out["subgroup all_reduce", name] = (mine, theirs)
            size = len(dist.get_process_group_ranks(group))
            y = rank_data(rank, size * 5, torch.float64, "SUM")
            mine, theirs = torch.empty(5, dtype=torch.float64), torch.empty(5, dtype=torch.float64)
            ring.reduce_scatter(mine, y, dist.ReduceOp.MAX, group, False)
            backend.reduce_scatter(theirs, y, dist.ReduceOp.MAX, group, False)
            out["subgroup reduce_scatter", name] = (mine, theirs)
            mine, theirs = torch.empty(size * 5, dtype=torch.float64), torch.empty(size * 5, dtype=torch.float64)
            ring.all_gather(mine, y[:5], group, False)
            backend.all_gather(theirs, y[:5], group, False)
            out["subgroup all_gather", name] = (mine, theirs)
            r = dist.get_process_group_ranks(group).index(rank)
            splits = split_matrix(size)
            a = rank_data(rank, sum(splits[r]) * 2, torch.float32, "SUM").view(-1, 2)
            incoming = [splits[i][r] for i in range(size)]
            mine, theirs = torch.empty(sum(incoming), 2), torch.empty(sum(incoming), 2)
            alltoall.all_to_all(mine, a, incoming, splits[r], group, False)
            backend.all_to_all(theirs, a, incoming, splits[r], group, False)
            out["subgroup all_to_all", name] = (mine, theirs)

    # through the door: use("ring") routes toolkit.comm's collectives here and the trace says so
    x = rank_data(rank, 7, torch.float32, "SUM")
    expected = x.clone()
    backend.all_reduce(expected, dist.ReduceOp.SUM, None, False)
    previous = toolkit.comm.use("ring")
    door = {"previous": previous, "implementation": toolkit.comm.implementation()}
    got = x.clone()
    toolkit.comm.all_reduce(got)
    door["impl"] = recorder.events[-1]["args"]["impl"]
    out["door all_reduce"] = (got, expected)
    got = x.clone()
    toolkit.comm.all_reduce(got, op="avg")
    out["door all_reduce avg"] = (got, expected / n)
    y = rank_data(rank, n * 3, torch.float32, "SUM")
    got, want = torch.empty(3), torch.empty(3)
    toolkit.comm.reduce_scatter(got, y)
    backend.reduce_scatter(want, y, dist.ReduceOp.SUM, None, False)
    out["door reduce_scatter"] = (got, want)
    got, want = torch.empty(n * 3), torch.empty(n * 3)
    toolkit.comm.all_gather(got, y[:3])
    backend.all_gather(want, y[:3], None, False)
    out["door all_gather"] = (got, want)
    got, want = torch.empty(n * 2, 3), torch.empty(n * 2, 3)
    toolkit.comm.all_to_all(got, y.repeat(2).view(n * 2, 3))
    backend.all_to_all(want, y.repeat(2).view(n * 2, 3), None, None, None, False)
    out["door all_to_all"] = (got, want)
    door["impls"] = [e["args"]["impl"] for e in recorder.events[-4:]]
    toolkit.comm.use("backend")
    got = x.clone()
    toolkit.comm.all_reduce(got)
    door["after restore"] = (toolkit.comm.implementation(), recorder.events[-1]["args"]["impl"])
    out["door backend all_reduce"] = (got, expected)
    out["door"] = door
    return out


_results = {}


def results(n):
    """Every rank's answers at world size n, computed once per test session (a failure, too)."""
    if n not in _results:
        try:
            _results[n] = toolkit.launch(run_every_case, n, args=(n,), timeout_s=30, quiet=True)
        except RankError as error:
            _results[n] = error
    if isinstance(_results[n], Exception):
        raise _results[n]
    return _results[n]


def assert_same(key, mine, theirs, rank, n):
    """Bitwise where order cannot matter (integers, MAX/MIN, data movement); allclose for float sums."""
    where = f"world size {n}, rank {rank}, {key}"
    assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape), (
        f"{where}: {mine.dtype}{tuple(mine.shape)} vs {theirs.dtype}{tuple(theirs.shape)}"
    )
    arithmetic = any(
        word in str(key) for word in ("SUM", "PRODUCT", "all_reduce", "reduce_scatter")
    ) and "keeps" not in str(key)
    if mine.dtype.is_floating_point and arithmetic and not any(op in str(key) for op in ("MAX", "MIN")):
        tol = 1e-5 if mine.dtype == torch.float32 else 1e-12
        torch.testing.assert_close(mine, theirs, rtol=tol, atol=tol, msg=lambda m: f"{where}: {m}")
    else:
        assert torch.equal(mine, theirs), (
            f"{where}: got {mine.flatten()[:8].tolist()} expected {theirs.flatten()[:8].tolist()}"
        )


def cases(n, prefix):
    """(key, (hand-written, backend), rank) for every case whose name starts with `prefix`."""
    found = False
    for rank, answers in enumerate(results(n)):
        for key, value in answers.items():
            if isinstance(key, tuple) and key[0].startswith(prefix):
                found = True
                yield key, value, rank
    assert found, f"no '{prefix}' cases at world size {n}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("prefix", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
def test_hand_written_collectives_match_the_backend(n, prefix):
    for key, (mine, theirs), rank in cases(n, prefix):
        assert_same(key, mine, theirs, rank, n)


@pytest.mark.timeout(120)
def test_subgroups_of_four_ranks():
    seen = set()
    for key, (mine, theirs), rank in cases(4, "subgroup"):
        assert_same(key, mine, theirs, rank, 4)
        seen.add((key[1], rank))
    assert seen == {("pair", r) for r in range(4)} | {("trio", r) for r in (0, 1, 3)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_talks_to_neighbours_and_sends_two_n_minus_one_over_n(n):
    for rank, answers in enumerate(results(n)):
        t = answers["traffic"]
        assert t["sent_to"] == ([] if n == 1 else [t["right"]]), f"rank {rank}: {t}"
        assert t["received_from"] == ([] if n == 1 else [t["left"]]), f"rank {rank}: {t}"
        assert t["elements_sent"] == t["expected_sent"], f"rank {rank}: {t}"
        assert answers["ring events"] == 0, "ring.py must not go through the door (double recording)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_use_ring_routes_the_door_and_use_backend_restores(n):
    for rank, answers in enumerate(results(n)):
        door = answers["door"]
        assert door["previous"] == "backend" and door["implementation"] == "ring"
        assert door["impl"] == "ring" and door["impls"] == ["ring"] * 4
        assert door["after restore"] == ("backend", "backend")
        for key in (
            "door all_reduce",
            "door all_reduce avg",
            "door reduce_scatter",
            "door all_gather",
            "door all_to_all",
            "door backend all_reduce",
        ):
            assert_same((key,), *answers[key], rank, n)


@pytest.mark.parametrize("n", range(1, 9))
def test_pairwise_schedule_exchanges_every_pair_once(n):
    schedules = [pairwise_schedule(rank, n) for rank in range(n)]
    for rank, schedule in enumerate(schedules):
        assert len(schedule) == n
        assert schedule[0] == (rank, rank), "step 0 is the local copy"
        assert sorted(to for to, _ in schedule) == list(range(n)), "sends to every position exactly once"
        assert sorted(frm for _, frm in schedule) == list(range(n)), "receives from every position exactly once"
    for step in range(n):
        for rank in range(n):
            send_to, recv_from = schedules[rank][step]
            assert schedules[send_to][step][1] == rank, "whoever I send to receives from me at the same step"
            assert schedules[recv_from][step][0] == rank
    pairs = {(rank, schedules[rank][step][0]) for rank in range(n) for step in range(n)}
    assert len(pairs) == n * n


def test_pairwise_schedule_matches_fastermoe():
    assert pairwise_schedule(1, 4) == [(1, 1), (0, 2), (3, 3), (2, 0)]
