"""The collectives door: results equal the math, and every call is recorded with the right bytes."""

import pytest
import torch

import toolkit
from toolkit import comm

pytestmark = pytest.mark.timeout(120)


def _door_checks():
    """Each collective through the door on this rank; returns what the parent checks."""
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    rec = toolkit.trace.recorder
    rec.reset()
    out = {}
    with toolkit.trace.phase("backward"):
        x = torch.full((7,), float(r + 1))
        comm.all_reduce(x)
        out["sum"] = x
        y = torch.full((7,), float(r + 1))
        h = comm.all_reduce(y, op="avg", async_op=True)
        assert isinstance(h, comm.Handle)
        h.wait()
        out["avg"] = y
    m = torch.tensor([float(r)])
    comm.all_reduce(m, op="max")
    out["max"] = m
    rs = torch.empty(2, dtype=torch.float64)
    comm.reduce_scatter(rs, torch.arange(2.0 * n, dtype=torch.float64), op="avg")
    out["rs_avg"] = rs
    ag = torch.empty(n, 3, dtype=torch.bfloat16)
    h = comm.all_gather(ag, torch.full((3,), float(r), dtype=torch.bfloat16), async_op=True)
    h.wait()
    out["ag"] = ag
    # uneven all-to-all: rank r sends j+1 rows to rank j, each row tagged (sender, receiver)
    send_splits = [j + 1 for j in range(n)]
    inp = torch.cat([torch.tensor([[r, j]] * (j + 1), dtype=torch.float32) for j in range(n)])
    recv_splits = [r + 1] * n
    outp = torch.empty(sum(recv_splits), 2)
    comm.all_to_all(outp, inp, recv_splits, send_splits)
    out["a2a"] = outp
    if n > 1:
        buf = torch.zeros(4)
        if r == 0:
            comm.send(torch.arange(4.0), dst=1)
        elif r == 1:
            comm.recv(buf, src=0)
        out["p2p"] = buf
    out["events"] = [dict(e, start=None, end=None) for e in rec.events if e["cat"] == "comm"]
    out["complete"] = all(e["end"] is not None and e["end"] >= e["start"] for e in rec.events)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_the_door_computes_and_records(n, no_leftover_ranks):
    results = toolkit.launch(_door_checks, n, timeout_s=30)
    for r, out in enumerate(results):
        torch.testing.assert_close(out["sum"], torch.full((7,), n * (n + 1) / 2))
        torch.testing.assert_close(out["avg"], torch.full((7,), (n + 1) / 2))
        assert out["max"].item() == n - 1
        torch.testing.assert_close(out["rs_avg"], torch.arange(2.0 * n, dtype=torch.float64)[2 * r : 2 * r + 2])
        assert out["ag"].tolist() == [[float(j)] * 3 for j in range(n)]
        expected = torch.cat([torch.tensor([[j, r]] * (r + 1), dtype=torch.float32) for j in range(n)])
        assert torch.equal(out["a2a"], expected)
        if r == 1:
            assert out["p2p"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert out["complete"], "every span must have an end, async ones included"

        events = {i: e for i, e in enumerate(out["events"])}
        ar = events[0]
        assert ar["name"] == "all_reduce" and ar["phase"] == "backward" and ar["cat"] == "comm"
        a = ar["args"]
        assert a["group"] == list(range(n)) and a["dtype"] == "float32" and a["numel"] == 7
        assert a["size_bytes"] == 28 and a["bytes_sent"] == a["bytes_recv"] == 2 * (n - 1) * 28 // n
        assert a["impl"] == "backend" and a["async_op"] is False
        assert events[1]["args"]["async_op"] is True and events[1]["args"]["op"] == "avg"
        assert events[2]["phase"] == "idle"
        rs = events[3]["args"]
        assert rs["size_bytes"] == 2 * n * 8 and rs["bytes_sent"] == (n - 1) * 2 * n * 8 // n
        ag = events[4]["args"]
        assert ag["dtype"] == "bfloat16" and ag["bytes_sent"] == (n - 1) * 3 * 2
        a2a = events[5]["args"]
        assert a2a["bytes_sent"] == (sum(j + 1 for j in range(n)) - (r + 1)) * 8
        assert a2a["bytes_recv"] == (n - 1) * (r + 1) * 8
        if r == 0:
            assert events[6]["name"] == "send" and events[6]["args"]["bytes_sent"] == 16
        if r == 1:
            assert events[6]["name"] == "recv" and events[6]["args"]["bytes_recv"] == 16


def _bad_shapes():
    import torch.distributed as dist

    n = dist.get_world_size()
    errors = []
    for call in (
        lambda: comm.reduce_scatter(torch.empty(3), torch.empty(3 * n + 1)),
        lambda: comm.all_gather(torch.empty(2 * n + 1), torch.empty(2)),
        lambda: comm.all_to_all(torch.empty(4), torch.empty(4), [1] * (n + 1), [1] * (n + 1)),
        lambda: comm.all_to_all(torch.empty(4), torch.empty(4), [1] * n, [3] * n),
        lambda: comm.all_reduce(torch.empty(2), op="mean"),
        lambda: comm.use("tree"),
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_shapes_are_clear_errors_before_anything_is_sent(no_leftover_ranks):
    errors = toolkit.launch(_bad_shapes, 2, timeout_s=30)[0]
    assert len(errors) == 6
    assert "Pad the input to a multiple of 2" in errors[0]
    assert "output.numel() == group size x input.numel()" in errors[1]
    assert "one split size per rank" in errors[2]
    assert "must add up to dim 0" in errors[3]
    assert "choose one of" in errors[4]
    assert "choose 'backend', 'ring'" in errors[5]


def _custom_implementation():
    """A student's implementation plugs in through `use({...})` and is what the trace reports."""
    calls = []

    def my_all_reduce(tensor, op, group, async_op):
        calls.append(tensor.numel())
        toolkit.comm.backend.all_reduce(tensor, op, group, False)

    x = torch.ones(5)
    with comm.using({"all_reduce": my_all_reduce}):
        h = comm.all_reduce(x, async_op=True)  # hand-written code runs synchronously
        assert h.is_completed()
        h.wait()
        impl_inside = comm.implementation()
    comm.all_reduce(torch.ones(2))
    return (
        calls,
        x.tolist(),
        impl_inside,
        comm.implementation(),
        [e["args"]["impl"] for e in toolkit.trace.recorder.events[-2:]],
    )


def test_a_custom_implementation_is_used_and_recorded(no_leftover_ranks):
    calls, x, inside, after, impls = toolkit.launch(_custom_implementation, 2, timeout_s=30)[0]
    assert calls == [5] and x == [2.0] * 5
    assert inside == "custom" and after == "backend" and impls == ["custom", "backend"]
