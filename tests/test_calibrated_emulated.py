"""An emulated link on this machine is a real loopback call, then a sleep to the emulated link's time
(`toolkit.comm.emulate`): the call takes the longer of the two, its loopback part holds the cores as the
calibration measured (overlap < 1) and only the sleep hides whole. The MoE pipeline's asynchronous all-to-alls
pay their loopback part on the compute stream (bench/sim_accuracy.py; docs/benchmarks.md)."""

import pytest
from test_sim_cost import calibration, comm

from toolkit.comm.emulate import Link, Settings
from toolkit.sim import Compute, Wait
from toolkit.sim.calibrate import from_measurements
from toolkit.sim.collective_time import collective_time
from toolkit.sim.timeline import schedule

LOOPBACK = {
    op: {"bandwidth": 1e9, "latency": 1e-3} for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
}


def machine(bandwidth, latency, overlap=0.25):
    links = dict(LOOPBACK, all_to_all={"bandwidth": 1e9, "latency": 1e-3})
    return from_measurements(calibration(links=links, overlap=overlap, lanes=2), Settings(Link(bandwidth, latency)))


def test_an_emulated_call_takes_the_longer_of_loopback_and_emulated_time_and_holds_the_cores_for_the_loopback():
    size = 64_000  # bytes of one rank's all-to-all: 32 kB to its one peer
    for slow in (True, False):
        found = machine(20e6 if slow else 1e12, 0.5e-3 if slow else 1e-9)
        cost = collective_time(found, "all_to_all", size, [0, 1], me=0)
        loopback = collective_time(found.underlay, "all_to_all", size, [0, 1], me=0).seconds
        assert loopback == pytest.approx(1e-3 + 32e3 / 1e9)  # one peer: alpha + its bytes at the loopback's rate
        emulated = 0.5e-3 + 32e3 / 20e6 if slow else loopback
        assert cost.seconds == pytest.approx(max(emulated, loopback))
        assert cost.cores == pytest.approx(0.75 * loopback)
    assert found.overlap == 1.0 and found.underlay.overlap == 0.25  # the sleep hides whole; the call does not


def test_the_compute_after_an_asynchronous_emulated_all_to_all_waits_for_its_loopback_part_only():
    found = machine(100e6, 0.5e-3)
    program = [comm(0, "all_to_all", 64_000, [0, 1]), Compute(0, label="expert"), Wait(0)]
    step = {}
    for name, cluster in (("with", found), ("without", found.with_changes(underlay=None))):
        step[name] = schedule(
            program,
            lambda c: 1e-3,
            lambda c, cluster=cluster: collective_time(cluster, c.op, c.size_bytes, c.group, 0, c.args),
            overlap=cluster.overlap,
        ).step_time
    loopback = 1e-3 + 32e3 / 1e9
    emulated = 0.5e-3 + 32e3 / 100e6
    assert step["without"] == pytest.approx(max(1e-3, emulated))  # the whole call hidden behind the experts
    assert step["with"] == pytest.approx(0.75 * loopback + 1e-3)  # the experts start once the loopback lets go


def test_an_emulated_all_to_all_holds_the_cores_for_its_bookings_on_the_store_per_peer_it_sends_to():
    """Before its loopback call, an emulated all-to-all books each chunk on the job's store (the receiver's side and
    the delivery: round trips every rank makes at once). That is host work the call's issue pays, measured by the
    calibration for world - 1 peers and charged for the peers this rank sends rows to; at 4 ranks under the
    bench's skewed routing it was 13-16 ms a step of the plain MoE layer and 55-70 ms of the pipelined one's 16
    calls, timed in `StoreLedger` (docs/benchmarks.md). A ring collective books nothing; it marks its issue (the
    test below)."""
    links = dict(LOOPBACK, all_to_all={"bandwidth": 1e9, "latency": 1e-3})
    m = calibration(links=links, overlap=0.25, lanes=2, world_size=4, emulator_bookings=3e-3)
    found = from_measurements(m, Settings(Link(20e6, 0.5e-3)))
    group, splits = [0, 1, 2, 3], dict(input_splits=[4, 4, 0, 4], output_splits=[4, 4, 4, 4])
    loopback = collective_time(found.underlay, "all_to_all", 64_000, group, me=0, args=splits).seconds
    cost = collective_time(found, "all_to_all", 64_000, group, me=0, args=splits)
    assert cost.cores == pytest.approx(3e-3 * 2 / 3 + 0.75 * loopback)  # two peers get rows (rank 0 keeps its own)
    assert collective_time(found, "all_reduce", 64_000, group, me=0).cores == pytest.approx(
        0.75 * collective_time(found.underlay, "all_reduce", 64_000, group, me=0).seconds
    )
    unmeasured = from_measurements(calibration(links=links, overlap=0.25, world_size=4), Settings(Link(20e6, 5e-4)))
    assert collective_time(unmeasured, "all_to_all", 64_000, group, me=0, args=splits).cores == pytest.approx(
        0.75 * loopback
    )  # a calibration from before the bookings were measured charges none


def test_an_emulated_ring_collective_or_barrier_holds_the_cores_for_its_issue_marks():
    """A ring collective or a barrier under the emulated link marks its issue in the job's store and reads its
    peers' marks once the real call is done (`toolkit.comm.deadlines`): host work the calibration measures once for
    the group, charged to every such call of two or more ranks, on top of the loopback call; an all-to-all pays its
    bookings instead, send and recv neither."""
    links = dict(LOOPBACK, all_to_all={"bandwidth": 1e9, "latency": 1e-3})
    m = calibration(links=links, overlap=0.25, lanes=2, world_size=4, emulator_bookings=3e-3, emulator_marks=2e-3)
    found = from_measurements(m, Settings(Link(20e6, 0.5e-3)))
    group = [0, 1, 2, 3]
    for op in ("all_reduce", "broadcast", "barrier"):
        size = 0 if op == "barrier" else 64_000
        loopback = collective_time(found.underlay, op, size, group, me=0).seconds
        cost = collective_time(found, op, size, group, me=0)
        assert cost.cores == pytest.approx(2e-3 + 0.75 * loopback), op
        assert cost.seconds >= 2e-3 + loopback, op  # the marks and the real call inside the emulated time at least
    alone = collective_time(found, "all_reduce", 64_000, [0], me=0)  # a group of one marks nothing
    assert alone.cores == pytest.approx(0.75 * collective_time(found.underlay, "all_reduce", 64_000, [0], me=0).seconds)
    to_all = collective_time(found, "all_to_all", 64_000, group, me=0)
    assert to_all.cores == pytest.approx(
        3e-3 + 0.75 * collective_time(found.underlay, "all_to_all", 64_000, group, 0).seconds
    )
    send = collective_time(found, "send", 64_000, [0, 1], me=0, args={"peer": 1})
    assert send.cores == pytest.approx(
        0.75 * collective_time(found.underlay, "send", 64_000, [0, 1], 0, {"peer": 1}).seconds
    )


@pytest.mark.parametrize("name", ["emulator_bookings", "emulator_marks"])
def test_the_calibration_measures_the_emulators_store_work_with_every_rank_at_once(name, no_leftover_ranks):
    import toolkit
    from toolkit.sim import calibrate_links

    found = toolkit.launch(getattr(calibrate_links, name), 2, timeout_s=60, quiet=True)
    assert all(0 < seconds < 0.1 for seconds in found)  # round trips to the store: microseconds to milliseconds


LATE = ((0.0, 0.1e-3), (2e-3, 0.5e-3), (10e-3, 2.5e-3), (30e-3, 4e-3))  # (compute, lateness), as a calibration measures


@pytest.mark.parametrize("compute, late", [(1e-3, 0.3e-3), (6e-3, 1.5e-3), (50e-3, 4e-3)])
def test_an_emulated_call_runs_from_its_groups_last_issue_which_comes_later_after_more_compute(compute, late):
    """Timeline rule 7: the emulated link's time runs from the group's last issue (`toolkit.comm.emulate`), and on
    shared cores the last rank comes later the more each computed since its previous call (`Cluster.late_peers`,
    linear between the measured points, the last one's beyond them). A synchronous emulated all-to-all after
    `compute` ends at compute + lateness + its emulated time; a calibration without the points, or a send, charges
    no lateness."""
    m = calibration(links=dict(LOOPBACK, all_to_all={"bandwidth": 1e9, "latency": 1e-3}), overlap=0.25, lanes=2)
    found = from_measurements(dict(m, world_size=4, late_peers=LATE), Settings(Link(20e6, 0.5e-3)))
    assert found.late_peers == LATE and found.underlay.late_peers == ()  # the loopback's cost has the lateness in it
    program = [Compute(0, label="experts"), comm(0, "all_to_all", 256_000, [0, 1, 2, 3]), Wait(0)]
    emulated = 3 * 0.5e-3 + 192e3 / 20e6  # three peers' latencies, then its 192 kB to them (64 kB each) at 20 MB/s

    def step(cluster):
        return schedule(
            program,
            lambda c: compute,
            lambda c: collective_time(cluster, c.op, c.size_bytes, c.group, 0, c.args),
            overlap=cluster.overlap,
        ).step_time

    assert step(found) == pytest.approx(compute + late + emulated)
    assert step(found.with_changes(late_peers=())) == pytest.approx(compute + emulated)
    send = collective_time(found, "send", 64_000, [0, 1], me=0, args={"peer": 1})
    assert send.from_last_issue is None  # a transfer's two halves are matched by the stages' timeline


def test_the_calibration_measures_how_late_the_last_rank_issues_with_every_rank_at_once(no_leftover_ranks):
    """Four ranks on the 2 cores, the same compute between small all-reduces: the last rank issues after the others,
    later after more compute (the loop's points: 0 to about 30 ms of compute)."""
    import toolkit
    from toolkit.sim import calibrate_late

    found = toolkit.launch(calibrate_late.late_peers, 4, timeout_s=60, quiet=True)
    points = found[0]
    assert found[1] == found[0] and len(points) == len(calibrate_late.LATE_GAPS)  # gathered: the same on each rank
    assert [c for c, _ in points] == sorted(c for c, _ in points) and points[-1][0] > 10 * points[1][0] > 0, points
    assert all(0 <= late < 0.1 for _, late in points), points  # a descheduled rank: a slice late even after none
    assert points[-1][1] > points[0][1], points  # more compute between the calls, a later last rank
