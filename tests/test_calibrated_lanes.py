"""This machine's collectives run two at a time: gloo's process group hands its queued collectives to a pool of
worker threads (`ProcessGroupGloo`'s Options.threads, 2 by default), so ZeRO-3's asynchronous reduce-scatter and
the all-gather called behind it run at once. The calibration reads the threads from the live group and the
overlap rule (`toolkit.sim.timeline`, rule 2) lets that many collectives share a link; NCCL's presets keep one."""

import pytest
from test_sim_cost import Cost, calibration, comm, fixed

import toolkit
from toolkit.sim import Compute, Wait, cluster_of
from toolkit.sim.collective_time import collective_time
from toolkit.sim.stage_timeline import schedule_stages
from toolkit.sim.timeline import schedule


class Lanes(Cost):
    def __init__(self, seconds, lanes):
        super().__init__(seconds)
        self.lanes = lanes


# ZeRO-3's backward: a unit's gradients reduce-scattered asynchronously, the next unit's parameters gathered behind
BACKWARD = [
    Compute(0, label="a"),
    comm(0, "reduce_scatter", 1, [0, 1]),
    comm(1, "all_gather", 1, [0, 1], async_op=False),
    Wait(1),
    Compute(0, label="b"),
    Wait(0),
]
TIMES = fixed({"a": 1.0, "b": 1.0})


def priced(lanes, overlap=0.05, program=BACKWARD, times=TIMES):
    return schedule(program, times, lambda c: Lanes(2.0 if c.op == "reduce_scatter" else 1.0, lanes), overlap=overlap)


def test_with_two_lanes_the_all_gather_runs_beside_the_reduce_scatter_and_compute_waits_for_the_cores_hold():
    """Two lanes: the all-gather (1 s) runs beside the reduce-scatter (2 s) and the next compute waits only for
    the reduce-scatter's hold on the cores, (1 - overlap) of it: a + 1.9 + b. One lane: it queues, a + 2 + 1 + b."""
    two, one = priced(2), priced(1)
    assert two.step_time == pytest.approx(1.0 + 0.95 * 2.0 + 1.0)
    assert one.step_time == pytest.approx(1.0 + 2.0 + 1.0 + 1.0)
    gather = next(s for s in two.spans if s.kind == "comm" and s.instruction.op == "all_gather")
    assert (gather.start, gather.end) == pytest.approx((1.0, 2.0))
    stalls = [s for s in two.spans if s.kind in ("wait", "host")]
    assert [s.kind for s in stalls] == ["wait", "host"]
    assert [(s.start, s.end) for s in stalls] == [pytest.approx((1.0, 2.0)), pytest.approx((2.0, 2.9))]
    # where the links are their own hardware (overlap 1) nothing holds the cores: the all-gather is all it waits for
    assert priced(2, overlap=1.0).step_time == pytest.approx(3.0) and priced(1, overlap=1.0).step_time == 5.0
    # a pipeline's stage replays the same rule
    staged = schedule_stages(
        {0: BACKWARD}, [], lambda k, c: TIMES(c), lambda k, c: Lanes(2.0 - (c.id == 1), 2), overlap=0.05
    )
    assert [(s.kind, s.start, s.end) for s in staged.stages[0].spans] == [
        (s.kind, s.start, s.end) for s in two.spans
    ] and staged.end == pytest.approx(two.end)


def test_views_between_two_collectives_do_not_wait_for_the_cores_hold():
    """Between an asynchronous collective and the next, a strategy's views (a flat buffer's slices, a parameter
    pointed at its gathered view) are microseconds of the host's dispatch, not work for the cores: they do not wait
    for the first collective's hold, so the second is issued beside it as before. A segment with kernels waits."""
    times = fixed({"a": 1.0, "b": 1.0, "between": 0.001})
    views = [*BACKWARD[:2], Compute(0, label="between", ops=3), *BACKWARD[2:]]
    for lanes in (1, 2):  # they ran while the reduce-scatter did
        assert priced(lanes, program=views, times=times).step_time == pytest.approx(priced(lanes).step_time)
    work = [*BACKWARD[:2], Compute(1e3, label="between", ops=3), *BACKWARD[2:]]  # it waits for the hold: 1.9 s
    assert priced(2, program=work, times=times).step_time == pytest.approx(1.0 + 1.9 + 0.001 + 1.0 + 1.0)


def test_the_calibrated_machine_prices_with_the_lanes_it_measured_and_the_presets_and_emulated_link_with_one():
    from toolkit.comm.emulate import Link, Settings
    from toolkit.sim.calibrate import from_measurements

    machine = from_measurements(calibration(lanes=2))
    assert machine.collective_lanes == 2
    assert collective_time(machine, "all_gather", 1 << 16, [0, 1]).lanes == 2
    assert from_measurements(calibration()).collective_lanes == 1  # a measurement that did not say: one queue
    emulated = from_measurements(calibration(lanes=2), Settings(Link(20e6, 0.5e-3)))
    assert emulated.collective_lanes == 1  # one emulated card: its messages queue on it
    for preset in ("dgx-a100", "dgx-h100"):
        assert collective_time(cluster_of(preset), "all_gather", 1 << 20, range(8)).lanes == 1


def _threads_of_groups():
    import torch.distributed as dist

    from toolkit.sim.calibrate_links import lanes

    options = dist.ProcessGroupGloo._Options()
    options._threads, options._devices = 3, [dist.ProcessGroupGloo.create_default_device()]
    store = dist.PrefixStore("three-threads", dist.distributed_c10d._get_default_store())
    three = dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), options)
    return lanes(), lanes(three), dist.ProcessGroupGloo._Options()._threads


@pytest.mark.timeout(120)
def test_the_calibration_reads_gloos_worker_threads_from_the_live_group():
    """2 on the default group (torch's default Options), 3 on a group made with three: read, not assumed."""
    default, three, torch_default = toolkit.launch(_threads_of_groups, 2, timeout_s=60, quiet=True)[0]
    assert default == torch_default == 2 and three == 3
