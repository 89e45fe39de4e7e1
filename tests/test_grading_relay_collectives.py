"""The grader's relay carries the collectives of labs 02-12 (`relay_collectives.py` on the rank, `relay_meet.py` in
the grader): every kind torch dispatches to a backend computes what gloo computes, a disagreement between ranks is
refused on every member with a message naming both calls (nothing hangs), the record it keeps counts the bytes
`toolkit.comm`'s trace counts, and a traffic check judges that record, never the rank's trace.

Cheap tests (the relay alone, or two forked ranks) run in the suite; the lab-04 replay carries `grading_scale`."""

import multiprocessing
import textwrap
import traceback
from pathlib import Path

import pytest
import torch

from toolkit.grading import grade
from toolkit.grading.relay import Relay
from toolkit.grading.relay_group import read_frame, send_frame

LABS = Path(__file__).resolve().parent.parent / "labs"


# --- the relay alone: frames as a rank writes them ---------------------------------------------------------------
def _ranks(relay, n=2):
    import socket

    socks = []
    for rank in range(n):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(relay.path)
        send_frame(sock, {"op": "hello", "rank": rank, "token": relay.tokens[rank]})
        socks.append(sock)
    return socks


def _call(sock, kind, tensor, id=1, **extra):
    message = {"op": "collective", "kind": kind, "group": "0", "members": [0, 1], "dtype": "float32", "id": id}
    message.update(size=tensor.numel(), **extra)
    send_frame(sock, message, tensor.numpy().tobytes())


def test_the_relay_computes_an_all_reduce_from_what_the_ranks_hand_in_and_records_it(tmp_path):
    with Relay(str(tmp_path), 2, [0], {"0": [b"{}", b"{}"]}) as relay:
        zero, one = _ranks(relay)
        _call(zero, "all_reduce", torch.tensor([1.0, 2.0]), reduce="sum")
        _call(one, "all_reduce", torch.tensor([10.0, 20.0]), reduce="sum")
        for sock in (zero, one):
            answer, payload = read_frame(sock, 1 << 20)
            assert answer == {"id": 1} and torch.frombuffer(bytearray(payload), dtype=torch.float32).tolist() == [
                11,
                22,
            ]
        record = {r: dict(relay.collectives[r]) for r in (0, 1)}
    args = {"group": [0, 1], "dtype": "float32", "numel": 2, "size_bytes": 8, "bytes_sent": 8, "bytes_recv": 8}
    assert record[0] == record[1] == {"import": [{"name": "all_reduce", "args": {**args, "reduce": "sum"}}]}


def test_an_answer_for_memory_freed_in_flight_is_refused_not_written():
    """The relay's answers are written from the rank's reading thread. An all-gather's output freed while it is in
    flight (FSDP's reshard without waiting: its storage resized to 0 bytes, the view keeping its shape) or a receive's
    buffer likewise is refused with a message, never written: the write would land in freed memory, crashing the rank
    or changing another tensor's bytes in a later check (lab 03's mutation run: a rank died of SIGSEGV in 5 of 9 runs,
    in the check of a mutant that launched after one that freed its gathered parameter early)."""
    from datetime import timedelta

    from toolkit.grading.relay_collectives import _Collective
    from toolkit.grading.relay_group import _Work

    for make in (lambda t: _Collective([t], timedelta(seconds=1)), _Work):
        flat = torch.zeros(64)
        work = make(flat[16:48])  # a view into the flat buffer, as a unit's parameter is
        payload = torch.ones(32).numpy().tobytes()
        flat.untyped_storage().resize_(0)  # freed while in flight
        with pytest.raises(ValueError, match="has no memory any more.*freed or resized while the message was in"):
            work.take(payload)
        assert not work.is_completed()
        flat.untyped_storage().resize_(64 * 4)  # given its bytes back: the same answer is written whole
        work.take(payload)
        assert work.is_completed() and torch.equal(flat[16:48], torch.ones(32))


@pytest.mark.parametrize(
    "one_calls, said",
    [
        (("all_gather", torch.zeros(2), {}), "rank 1 called all_gather"),  # another collective
        (("all_reduce", torch.zeros(3), {"reduce": "sum"}), "differ in size"),  # another shape
        (("all_reduce", torch.zeros(2), {"reduce": "max"}), "differ in reduce"),  # another op
    ],
)
def test_ranks_that_disagree_on_a_collective_are_both_refused_with_what_each_called(one_calls, said, tmp_path):
    with Relay(str(tmp_path), 2, [0], {"0": [b"{}", b"{}"]}) as relay:
        zero, one = _ranks(relay)
        _call(zero, "all_reduce", torch.zeros(2), reduce="sum")
        kind, tensor, extra = one_calls
        _call(one, kind, tensor, **extra)
        for sock in (zero, one):
            answer, payload = read_frame(sock, 1 << 20)
            assert "rank 0 called all_reduce" in answer["error"] and said in answer["error"], answer
            assert "1st collective" in answer["error"] and payload == b""
        assert relay.collectives[0]["import"] == [None]  # refused: nothing carried


def test_an_all_to_all_whose_splits_disagree_is_refused_and_one_that_lies_about_its_bytes_too(tmp_path):
    with Relay(str(tmp_path), 2, [0], {"0": [b"{}", b"{}"]}) as relay:
        zero, one = _ranks(relay)
        _call(zero, "all_to_all", torch.zeros(3), sent=[1, 2], received=[1, 1])
        _call(one, "all_to_all", torch.zeros(2), sent=[1, 1], received=[1, 1])  # expects 1 from rank 0, sent 2
        for sock in (zero, one):
            assert "rank 0 sends rank 1 2 elements, rank 1 expects 1" in read_frame(sock, 1 << 20)[0]["error"]
        message = {"op": "collective", "kind": "all_reduce", "group": "0", "members": [0, 1], "dtype": "float32"}
        send_frame(zero, {**message, "size": 1, "reduce": "sum", "id": 2}, b"\0" * 400)
        assert "400 bytes handed in for 1 float32 elements" in read_frame(zero, 1 << 20)[0]["error"]


# --- two forked ranks on the relay: every kind, the record against toolkit.comm's trace, timeouts ---------------
def _on_ranks(tmp_path, body, n=2, seconds=60):
    """Run body(rank, n) on n forked ranks whose default group is the relay's; {rank: error text or ""}, record."""
    results = multiprocessing.get_context("fork").Queue()

    def main(rank, path, token):
        import torch.distributed as dist

        from toolkit.grading import relay_group
        from toolkit.grading.relay_collectives import CollectiveGroup

        try:
            relay_group.switch(relay_group.connect(path, rank, token), rank, n, CollectiveGroup)
            body(rank, n, dist)
            results.put((rank, ""))
        except BaseException:  # noqa: BLE001 - the test reads it
            results.put((rank, traceback.format_exc()))

    with Relay(str(tmp_path), n, [], {}) as relay:
        ranks = [
            multiprocessing.get_context("fork").Process(target=main, args=(r, relay.path, relay.tokens[r]))
            for r in range(n)
        ]
        for process in ranks:
            process.start()
        found = dict(results.get(timeout=seconds) for _ in range(n))
        for process in ranks:
            process.join(10)
        return found, {r: relay.collectives[r].get("import", []) for r in range(n)}


def _every_kind(rank, n, dist):
    me = torch.arange(4, dtype=torch.float32) + 10 * rank
    x = me.clone()
    dist.all_reduce(x)
    assert x.tolist() == [10.0, 12.0, 14.0, 16.0], x
    out = torch.empty(8)
    dist.all_gather_into_tensor(out, me)
    assert out.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    parts = [torch.empty(4) for _ in range(n)]
    dist.all_gather(parts, me)
    assert torch.cat(parts).tolist() == out.tolist()
    mine = torch.empty(2)
    dist.reduce_scatter_tensor(mine, me)
    assert mine.tolist() == ([10.0, 12.0] if rank == 0 else [14.0, 16.0])
    dist.reduce_scatter(mine, list(me.chunk(2)), op=dist.ReduceOp.MAX)
    assert mine.tolist() == ([10.0, 11.0] if rank == 0 else [12.0, 13.0])
    rows = torch.arange(6 * 2, dtype=torch.float32).reshape(6, 2) + 100 * rank  # uneven: rank 0 sends 1 row to 0
    splits_in = [1, 5] if rank == 0 else [2, 4]
    splits_out = [1, 2] if rank == 0 else [5, 4]
    got = torch.empty(sum(splits_out), 2)
    dist.all_to_all_single(got, rows, splits_out, splits_in)
    expected = torch.cat(
        [(torch.arange(12.0).reshape(6, 2) + 100 * src).split([[1, 5], [2, 4]][src])[rank] for src in range(n)]
    )
    assert torch.equal(got, expected), (got, expected)
    y = me.clone()
    dist.broadcast(y, src=1)
    assert y.tolist() == [10.0, 11.0, 12.0, 13.0]
    work = dist.all_reduce(me.clone(), async_op=True)
    work.wait()
    dist.barrier()
    pair = dist.new_group([0, 1])
    z = torch.ones(3, dtype=torch.int64)
    dist.all_reduce(z, group=pair)
    assert z.tolist() == [2, 2, 2]
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": 0}, {"rank": 1}]
    total = me.clone()
    dist.reduce(total, dst=1)
    assert total.tolist() == ([0.0, 1.0, 2.0, 3.0] if rank == 0 else [10.0, 12.0, 14.0, 16.0])
    listed = [torch.empty(4) for _ in range(n)] if rank == 0 else None
    dist.gather(me, listed, dst=0)
    assert rank == 1 or torch.cat(listed).tolist() == out.tolist()
    piece = torch.empty(2)
    dist.scatter(piece, list(me.chunk(2)) if rank == 1 else None, src=1)
    assert piece.tolist() == ([10.0, 11.0] if rank == 0 else [12.0, 13.0])


def test_every_collective_torch_dispatches_computes_what_gloo_computes_on_the_relay(tmp_path):
    errors, record = _on_ranks(tmp_path, _every_kind)
    assert errors == {0: "", 1: ""}, errors
    names = [e["name"] for e in record[0]]
    assert names == (
        ["all_reduce", "all_gather", "all_gather", "reduce_scatter", "reduce_scatter", "all_to_all", "broadcast"]
        + ["all_reduce", "barrier", "all_reduce", "all_gather", "all_gather", "reduce", "gather", "scatter"]
    ), names
    assert record[0][5]["args"]["sent"] == [2, 10] and record[1][5]["args"]["received"] == [10, 8]
    assert [record[r][12]["args"]["bytes_sent"] for r in (0, 1)] == [16, 0]  # reduce to rank 1: rank 0's 4 floats
    assert [record[r][14]["args"]["bytes_recv"] for r in (0, 1)] == [8, 0]  # scatter from rank 1: 2 floats to 0


def _through_toolkit_comm(rank, n, dist):
    """toolkit.comm's own collectives: the relay's record of each must say what the rank's trace says."""
    from toolkit import comm
    from toolkit.trace.events import recorder

    recorder.reset()
    x = torch.ones(6)
    comm.all_reduce(x)
    comm.reduce_scatter(torch.empty(3), torch.ones(6))
    comm.all_gather(torch.empty(12, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16))
    comm.broadcast(x, src=0)
    comm.all_to_all(
        torch.empty(3 if rank == 0 else 5, 2),
        torch.ones(4, 2),
        [1, 2] if rank == 0 else [3, 2],
        [1, 3] if rank == 0 else [2, 2],
    )
    comm.all_reduce(x, async_op=True).wait()
    keys = ("group", "dtype", "numel", "size_bytes", "bytes_sent", "bytes_recv")
    traced = [[e["name"], {k: e["args"][k] for k in keys}] for e in recorder.events if e.get("cat") == "comm"]
    _TRACED.put((rank, traced))


_TRACED = multiprocessing.get_context("fork").Queue()


def test_the_relays_record_counts_the_bytes_toolkit_comms_trace_counts(tmp_path):
    errors, record = _on_ranks(tmp_path, _through_toolkit_comm)
    assert errors == {0: "", 1: ""}, errors
    traced = dict(_TRACED.get(timeout=10) for _ in range(2))
    keys = ("group", "dtype", "numel", "size_bytes", "bytes_sent", "bytes_recv")
    for rank in (0, 1):
        carried = [[e["name"], {k: e["args"][k] for k in keys}] for e in record[rank]]
        assert carried == traced[rank], (rank, carried, traced[rank])


def _disagree(rank, n, dist):
    x = torch.zeros(4)
    if rank == 0:
        dist.all_reduce(x)
    else:
        dist.all_gather_into_tensor(torch.empty(8), x)


def _absent(rank, n, dist):
    import datetime

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        dist.all_reduce(torch.zeros(2), group=group)


def test_a_mismatch_is_refused_on_both_ranks_and_a_peer_that_never_comes_times_out(tmp_path):
    errors, record = _on_ranks(tmp_path, _disagree)
    for rank in (0, 1):
        assert "rank 0 called all_reduce (4 float32 elements per rank, reduce sum)" in errors[rank], errors[rank]
        assert "rank 1 called all_gather" in errors[rank] and "same collectives in the same order" in errors[rank]
    assert record == {0: [None], 1: [None]}
    (tmp_path / "absent").mkdir()
    errors, _ = _on_ranks(tmp_path / "absent", _absent)
    assert "not joined by every rank of its group within 2 s" in errors[0] and errors[1] == "", errors


# --- a traffic check reads the relay's record, not the rank's trace ---------------------------------------------
FAKE_TRACE = '''

from toolkit.trace.events import recorder as _recorder


def _faked(x, out_splits, in_splits, group, label):
    """The red team's attack: no all-to-all at all, the rows kept at home, and the trace the check used to read
    written by hand (five all-to-alls, labelled as the check wanted them)."""
    event = _recorder.add("all_to_all", "comm", _recorder.mark(), group=[0, 1], dtype="float32", numel=x.numel(),
                          size_bytes=0, bytes_sent=0, bytes_recv=0, impl="backend", async_op=False, moe=label)
    event["end"] = event["start"]
    return x.new_zeros((sum(out_splits),) + tuple(x.shape[1:]))


send_rows = _faked
'''


@pytest.mark.grading_scale
def test_lab_04s_fake_trace_attack_fails_the_traffic_check(tmp_path):
    """Red team, issue 29's open item 1: a lab-04 submission that keeps its rows at home and writes the all-to-all
    trace the traffic check read scored that check. The check now reads what the grader's relay carried: nothing."""
    submission = tmp_path / "fake_trace.py"
    submission.write_text((LABS / "04-moe-dispatch" / "solution.py").read_text() + textwrap.dedent(FAKE_TRACE))
    score = grade(LABS / "04-moe-dispatch", submission)
    (trace,) = [r for r in score.results if r.name.startswith("the trace")]
    assert trace.earned == 0 and "made the grader's relay carry no collective" in trace.message, trace.message


TASKS = """
def summed(student, rank, given):
    x = given["x"].clone()
    start = rank.events_now()
    student.summed(x, rank.group)
    return {"x": x, "comms": rank.comm_events(start)}
"""

CHECKS = """
import torch

from toolkit.grading import Fields, Tensor, check


def SAME(n, g):
    return {"x": torch.randn(4, generator=g)}  # every rank holds the same x


@check("the sum over two ranks", points=1, world_sizes=(2,), inputs=SAME)
def summed(ctx, given, got):
    for r in range(2):
        ctx.expect(got[r]["x"], 2 * given[r]["x"], "the sum", rank=r, exact=False)


COMM = Fields({"name": str, "args": Fields({"group": [int]}, extra=True)})


@check("the traffic: one all-reduce of x over both ranks", points=1, world_sizes=(2,), inputs=SAME, task="summed",
       returns={"x": Tensor((4,), torch.float32), "comms": [COMM]})
def traffic(ctx, given, got):
    for r in range(2):
        calls = [(e["name"], e["args"]["group"], e["args"]["numel"], e["args"]["bytes_sent"]) for e in got[r]["comms"]]
        if calls != [("all_reduce", [0, 1], 4, 16)]:
            ctx.fail(f"rank {r}: the grader's relay carried {calls or 'no collective'}")
"""

LOCAL_AND_FAKED = """
from toolkit.trace.events import recorder


def summed(x, group):
    x.mul_(2)  # every rank holds the same x: the sum needs no collective, and none is called
    recorder.add("all_reduce", "comm", recorder.mark(), group=[0, 1], dtype="float32", numel=4, size_bytes=16,
                 bytes_sent=16, bytes_recv=16, impl="backend", async_op=False)  # the trace the check used to read
"""


def test_a_submission_that_computes_locally_and_fakes_its_trace_fails_the_traffic_check(tmp_path):
    """The answer is right (so the value check passes) and the rank's trace says one all-reduce of x; the grader's
    relay carried nothing, and the traffic check reads the relay."""
    lab = tmp_path / "lab"
    lab.mkdir()
    for name, text in (
        ("tasks", TASKS),
        ("checks", CHECKS),
        ("skeleton", "def summed(x, group):\n    raise NotImplementedError\n"),
    ):
        (lab / f"{name}.py").write_text(text)
    (tmp_path / "cheat.py").write_text(LOCAL_AND_FAKED)
    score = grade(lab, tmp_path / "cheat.py")
    value, traffic = score.results
    assert value.earned == 1, value.message
    assert traffic.earned == 0 and "the grader's relay carried no collective" in traffic.message, traffic.message


def test_the_emulated_links_bookings_are_shared_through_the_relay_and_nothing_else_is(tmp_path):
    """`toolkit.comm.emulate` books its links on the job's store; the ranks' store is their own, so the relay keeps
    those bookings for every rank (times under a ledger key: a link's calendar, a note) and refuses anything else,
    or too much."""
    from toolkit.comm.store_ledger import PREFIX
    from toolkit.grading.relay_store import Agreeing

    with Relay(str(tmp_path), 2, [0], {"0": [b"{}", b"{}"]}) as relay:
        zero, one = _ranks(relay)
        key = "default_pg/" + PREFIX + "card/0"
        booking = {"op": "booking", "do": "compare_set", "key": key, "expected": "", "value": "1.5 42.1", "id": 1}
        send_frame(zero, booking)
        assert read_frame(zero, 1 << 20) == ({"id": 1}, b"1.5 42.1")
        send_frame(one, {**booking, "do": "get"})
        assert read_frame(one, 1 << 20) == ({"id": 1}, b"1.5 42.1")  # rank 1 sees rank 0's booking
        calendar = {**booking, "key": key + "/recv", "value": "1.5 1.6 1.8 2.25e-05 42.2"}  # intervals, then the mark
        send_frame(zero, calendar)
        assert read_frame(zero, 1 << 20) == ({"id": 1}, b"1.5 1.6 1.8 2.25e-05 42.2")
        for bad in ({"key": "a/key/of/its/own"}, {"value": "the other rank's tokens"}, {"value": "1.5 " * 2000}):
            send_frame(one, {**booking, **bad})
            assert "the grader's relay refused" in read_frame(one, 1 << 20)[0]["error"]
    store = Agreeing()  # no relay: a rank's own store, every rendezvous met
    assert (
        store.compare_set("k", "", "v") == b"v" and store.compare_set("k", "x", "w") == b"v" and store.get("k") == b"v"
    )


def test_the_relay_keeps_a_bounded_amount_of_bookings():
    """A calendar is a few numbers, but a submission writes what it likes: the relay keeps at most MAX_BYTES of
    values, then refuses new bytes (a shorter value for a key it keeps is still taken)."""
    from toolkit.comm.store_ledger import PREFIX
    from toolkit.grading.relay_store import MAX_BYTES, MAX_VALUE, Bookings

    bookings, value = Bookings(), ("1.5 " * (MAX_VALUE // 4 - 1) + "1.5")[:MAX_VALUE].strip()
    kept = 0
    with pytest.raises(ValueError, match="MiB of bookings"):
        while True:
            bookings.handle({"do": "set", "key": PREFIX + f"card/{kept}", "value": value})
            kept += 1
    assert kept == MAX_BYTES // len(value) and bookings.bytes <= MAX_BYTES
    bookings.handle({"do": "compare_set", "key": PREFIX + "card/0", "expected": value, "value": "2.5 42.1"})
    assert bookings.values[PREFIX + "card/0"] == b"2.5 42.1" and bookings.bytes == (kept - 1) * len(value) + 8
