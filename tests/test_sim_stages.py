"""Several stages' programs on one clock (`toolkit.sim.stage_timeline`): the interface a pipeline schedule
hands the cost model. A hand-built two-stage GPipe step, its bubble against (p-1)/(m+p-1), transfers on
the critical path and on the right link, one stage equal to the one-rank rule, and a deadlock named."""

import pytest

from toolkit.sim import Collective, Compute, Wait, cluster_of
from toolkit.sim.collective_time import collective_time
from toolkit.sim.pipelined import estimate_stages
from toolkit.sim.stage_timeline import P2P, schedule_stages
from toolkit.sim.timeline import schedule

F, B = 1.0, 2.0  # seconds of one micro-batch's forward, backward on one stage


def p2p(i, op, peer, phase, group=(0, 1)):
    return Collective(i, op, 1 << 20, 1 << 20, 0, tuple(group), True, phase=phase, args={"peer": peer})


def gpipe_two_stages(m=2, ranks=(0, 1)):
    """GPipe on 2 stages (on global ranks `ranks`), m micro-batches: stage 0 sends activations (ids 0..m-1) and
    receives gradients (ids m..2m-1); stage 1 the other way round. All forwards, then all backwards."""
    s0, s1 = [], []
    r0, r1 = ranks
    for k in range(m):
        s0 += [Compute(0, phase="forward", label="F"), p2p(k, "send", r1, "forward", ranks)]
        s1 += [p2p(k, "recv", r0, "forward", ranks), Wait(k, "forward"), Compute(0, phase="forward", label="F")]
    for k in range(m):
        s1 += [Compute(0, phase="backward", label="B"), p2p(m + k, "send", r0, "backward", ranks)]
        s0 += [
            p2p(m + k, "recv", r1, "backward", ranks),
            Wait(m + k, "backward"),
            Compute(0, phase="backward", label="B"),
        ]
    s0 += [Wait(k, "backward") for k in range(m)]
    s1 += [Wait(m + k, "backward") for k in range(m)]
    pairs = [P2P(send=(0, k), recv=(1, k)) for k in range(m)] + [
        P2P(send=(1, m + k), recv=(0, m + k)) for k in range(m)
    ]
    return {0: s0, 1: s1}, pairs


class Cost:
    def __init__(self, seconds, resources=("link",)):
        self.seconds, self.resources = seconds, resources


def hand(stage, c):
    return {"F": F, "B": B}[c.label]


@pytest.mark.parametrize("m", [2, 4, 8])
def test_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1_when_transfers_are_free(m):
    programs, pairs = gpipe_two_stages(m)
    t = schedule_stages(programs, pairs, hand, lambda stage, c: Cost(0.0))
    assert t.step_time == pytest.approx((m + 1) * (F + B))  # (m + p - 1) slots of F + B
    for stage in (0, 1):
        assert t.bubble(stage) == pytest.approx(1 / (m + 1))
    first = [(s.kind, s.start, s.end) for s in t.stages[1].spans][:3]  # stage 1 idles until the first send
    assert first == [("comm", F, F), ("wait", 0.0, F), ("compute", F, 2 * F)]


def test_transfers_on_the_critical_path_are_paid_where_a_stage_waits_for_them():
    """Two micro-batches, each transfer c seconds. Stage 1's first forward waits for one; the second activation
    leaves stage 0 at 2 but stage 1 posts its receive only after its first forward (2 + c); the first gradient
    reaches stage 0 after stage 1's first backward; the last one after its second: 9 + 4c, by hand."""
    c = 0.25
    programs, pairs = gpipe_two_stages(2)
    t = schedule_stages(programs, pairs, hand, lambda stage, x: Cost(c))
    assert t.step_time == pytest.approx(9 + 4 * c)
    # stage 1 computes until 7 + 2c; its last send completes with the transfer, when stage 0 takes it: 7 + 4c
    assert t.stages[0].end == pytest.approx(9 + 4 * c) and t.stages[1].end == pytest.approx(7 + 4 * c)
    ends = {s.instruction.id: s.end for s in t.stages[0].spans if s.kind == "comm"}
    assert ends == {s.instruction.id: s.end for s in t.stages[1].spans if s.kind == "comm"}  # one transfer, two halves


def test_stages_on_two_nodes_send_over_the_network_and_on_one_node_over_nvlink():
    """The cost model's own collective times: 1 MiB between ranks 0 and 1 goes over NVLink, between ranks 0 and
    8 (two DGX nodes) over one InfiniBand card (each at its measured rate), and the step grows by the difference
    on the critical path."""
    one_node = estimate_stages(*gpipe_two_stages(2, (0, 1)), "dgx-a100", ranks={0: 0, 1: 1}, world_size=16)
    two_nodes = estimate_stages(*gpipe_two_stages(2, (0, 8)), "dgx-a100", ranks={0: 0, 1: 8}, world_size=16)
    links = {s.cost.link for s in two_nodes.stages[0].spans if s.kind == "comm"}
    assert links == {"inter-node"} and {s.cost.link for s in one_node.stages[0].spans if s.kind == "comm"} == {
        "intra-node"
    }
    dgx = cluster_of("dgx-a100")
    per_transfer = (
        collective_time(dgx, "send", 1 << 20, (0, 8), 0, dict(peer=8)).seconds
        - collective_time(dgx, "send", 1 << 20, (0, 1), 0, dict(peer=1)).seconds
    )
    assert two_nodes.step_time - one_node.step_time == pytest.approx(4 * per_transfer, rel=1e-9)


def test_one_stage_is_the_one_rank_overlap_rule():
    program = [
        Compute(0, label="F"),
        Collective(0, "all_reduce", 1, 0, 0, (0, 1), True),
        Compute(0, label="B"),
        Wait(0),
        Compute(0, label="F"),
    ]
    alone = schedule(program, lambda c: hand(0, c), lambda c: Cost(1.5))
    staged = schedule_stages({0: program}, [], hand, lambda stage, c: Cost(1.5)).stages[0]
    assert [(s.kind, s.start, s.end) for s in staged.spans] == [(s.kind, s.start, s.end) for s in alone.spans]
    assert staged.end == alone.end


def test_a_schedule_that_deadlocks_names_each_stages_blocked_instruction():
    s0 = [p2p(0, "recv", 1, "forward"), Wait(0, "forward"), p2p(1, "send", 1, "forward")]
    s1 = [p2p(1, "recv", 0, "forward"), Wait(1, "forward"), p2p(0, "send", 0, "forward")]
    pairs = [P2P(send=(1, 0), recv=(0, 0)), P2P(send=(0, 1), recv=(1, 1))]
    with pytest.raises(
        ValueError, match=r"deadlock.*stage 0 at instruction 1, Wait\(id=0.*stage 1 at instruction 1, Wait\(id=1"
    ):
        schedule_stages({0: s0, 1: s1}, pairs, hand, lambda stage, c: Cost(0.1))
    with pytest.raises(ValueError, match="stage 2 has no program"):
        schedule_stages({0: s0, 1: s1}, [P2P(send=(0, 1), recv=(2, 0))], hand, lambda stage, c: Cost(0.1))
