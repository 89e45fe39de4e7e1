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
