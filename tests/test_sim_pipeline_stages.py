"""Pipeline schedules replayed on the cost model's stage timeline (`toolkit.sim.stage_timeline`), from hand-written
action lists: 1F1B and Megatron-LM's interleaved schedule on 4 stages, their bubbles against (p-1)/(m+p-1) and
(p-1)/(v·m+p-1), sends matched with receives in order as NCCL matches them, transfers on the link between the
stages' nodes, and what the step's time is made of on each stage."""

import pytest

from toolkit.sim import Collective, Compute, Wait
from toolkit.sim.pipelined import estimate_stages
from toolkit.sim.stage_timeline import P2P, pair_transfers, schedule_stages

F, B = 1.0, 2.0  # seconds of one micro-batch's forward and backward through one rank's layers
MESSAGE = 1 << 20
RATE = 1e12  # a hand-priced compute segment's FLOPs per second


def one_f_one_b(p, m, rank):
    """PipeDream-Flush: p - rank - 1 warm-up forwards, then one forward one backward, then the cool-down."""
    warm = min(p - rank - 1, m)
    out = [("F", i, rank) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i, rank), ("B", i, rank)]
    return out + [("B", i, rank) for i in range(m - warm, m)]


def interleaved(p, m, rank, v):
    """Narayanan et al.'s interleaved 1F1B: rank r holds stages r, r + p, ...; micro-batches go p at a time
    through one of its stages, then the next; warm-up (p - rank - 1)·2 + (v - 1)·p forwards."""

    def micro(k):
        return (k // (p * v)) * p + k % p

    def forward(k):
        return ("F", micro(k), ((k // p) % v) * p + rank)

    def backward(k):
        return ("B", micro(k), (v - 1 - (k // p) % v) * p + rank)

    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    out = [forward(k) for k in range(warm)]
    for k in range(total - warm):
        out += [forward(warm + k), backward(k)]
    return out + [backward(k) for k in range(total - warm, total)]


def lower(actions, p, stages, ranks, seconds):
    """Each pipeline rank's program, as the runtime issues it: a forward receives its input from the previous
    stage's rank (a blocking receive) and sends its output on (asynchronously, waited at the step's end); a
    backward the same the other way. ranks: pipeline rank -> global rank; seconds(kind, stage) -> compute."""
    programs = {}
    for r, mine in enumerate(actions):
        program, sends, ids = [], [], iter(range(10**6))

        def transfer(op, stage, phase, r=r, program=program, sends=sends, ids=ids):
            c = Collective(
                next(ids),
                op,
                MESSAGE,
                MESSAGE if op == "send" else 0,
                MESSAGE if op == "recv" else 0,
                tuple(sorted({ranks[r], ranks[stage % p]})),
                op == "send",
                phase=phase,
                args={"peer": ranks[stage % p]},
            )
            program.append(c)
            if op == "recv":
                program.append(Wait(c.id, phase))
            else:
                sends.append(c.id)

        for kind, micro, stage in mine:
            phase = "forward" if kind == "F" else "backward"
            previous, following = (stage - 1, stage + 1) if kind == "F" else (stage + 1, stage - 1)
            if 0 <= previous < stages:
                transfer("recv", previous, phase)
            program.append(Compute(seconds(kind, stage) * RATE, phase=phase, label=f"{stage}{kind}{micro}"))
            if 0 <= following < stages:
                transfer("send", following, phase)
        programs[ranks[r]] = program + [Wait(i, "backward") for i in sends]
    return programs


class Cost:
    def __init__(self, seconds):
        self.seconds, self.resources = seconds, ("link",)


def unit(v=1):
    """F and B of one stage when a rank's layers are cut into v stages."""
    return lambda kind, stage: (F if kind == "F" else B) / v


def replay(programs, seconds_per_transfer=0.0):
    return schedule_stages(
        programs, pair_transfers(programs), lambda stage, c: c.flops / RATE, lambda stage, c: Cost(seconds_per_transfer)
    )


@pytest.mark.parametrize("m", [4, 8, 12])
def test_1f1b_on_four_stages_takes_m_plus_p_minus_1_slots_and_its_bubble_is_the_formula(m):
    p = 4
    programs = lower([one_f_one_b(p, m, r) for r in range(p)], p, p, list(range(p)), unit())
    t = replay(programs)
    assert t.step_time == pytest.approx((m + p - 1) * (F + B))
    for stage in range(p):
        assert t.bubble(stage) == pytest.approx((p - 1) / (m + p - 1))
        parts = t.breakdown(stage)
        assert parts["compute"] == pytest.approx(m * (F + B)) and parts["p2p"] == 0 and parts["exposed_comm"] == 0
        assert parts["compute"] + parts["bubble"] == pytest.approx(t.step_time)


@pytest.mark.parametrize("v", [2, 3])
def test_the_interleaved_schedule_divides_the_bubble_by_the_virtual_stages(v):
    """Each rank's layers cut into v stages (each F/v and B/v): the bubble is (p-1)/(v·m + p-1) of the step."""
    p, m = 4, 8
    programs = lower([interleaved(p, m, r, v) for r in range(p)], p, p * v, list(range(p)), unit(v))
    t = replay(programs)
    assert t.step_time == pytest.approx(m * (F + B) + (p - 1) * (F + B) / v)
    for stage in programs:
        assert t.bubble(stage) == pytest.approx((p - 1) / (v * m + p - 1))
    plain = replay(lower([one_f_one_b(p, m, r) for r in range(p)], p, p, list(range(p)), unit()))
    assert plain.step_time - t.step_time == pytest.approx((p - 1) * (F + B) * (1 - 1 / v))
    sent = {
        rank: sum(1 for c in program if isinstance(c, Collective) and c.op == "send")
        for rank, program in programs.items()
    }
    sent_plain = {
        rank: sum(1 for c in program if isinstance(c, Collective) and c.op == "send")
        for rank, program in lower([one_f_one_b(p, m, r) for r in range(p)], p, p, list(range(p)), unit()).items()
    }
    assert sum(sent.values()) == v * sum(sent_plain.values()) + 2 * m * (v - 1)  # v times the messages, and the wrap
    #                                                                         (last rank -> first) both ways


def test_transfers_on_the_critical_path_lengthen_the_step_and_show_as_p2p_time():
    """With every transfer costing c, 1F1B's step grows by the transfers on its critical path: at least the
    first micro-batch's forward down the pipeline and the last one's backward back up, 2(p-1) of them; at most
    those and one before each of the last stage's 2m actions (in the steady state each of its forwards waits for
    an activation and the stage before waits for its gradient). Each stage's waits split into bubble (another
    stage computing) and p2p (its data on the wire)."""
    p, m, c = 4, 8, 0.1
    programs = lower([one_f_one_b(p, m, r) for r in range(p)], p, p, list(range(p)), unit())
    free, paid = replay(programs), replay(programs, c)
    assert paid.step_time - free.step_time >= 2 * (p - 1) * c - 1e-9
    assert paid.step_time - free.step_time <= (2 * m + 2 * (p - 1)) * c + 1e-9
    last = paid.breakdown(p - 1)
    assert last["p2p"] > 0 and last["compute"] + last["bubble"] + last["p2p"] == pytest.approx(paid.step_time)


def test_sends_are_matched_with_receives_in_the_order_nccl_matches_them():
    """pair_transfers finds, from the recorded programs alone, the pairs a hand-built list names."""
    p, m = 2, 3
    programs = lower([one_f_one_b(p, m, r) for r in range(p)], p, p, [0, 1], unit())
    sends = {r: [c.id for c in prog if isinstance(c, Collective) and c.op == "send"] for r, prog in programs.items()}
    recvs = {r: [c.id for c in prog if isinstance(c, Collective) and c.op == "recv"] for r, prog in programs.items()}
    expected = {P2P(send=(0, s), recv=(1, r)) for s, r in zip(sends[0], recvs[1])} | {
        P2P(send=(1, s), recv=(0, r)) for s, r in zip(sends[1], recvs[0])
    }
    assert set(pair_transfers(programs)) == expected and len(expected) == 2 * m


def test_a_pipeline_across_nodes_sends_on_the_network_and_inside_a_node_on_nvlink():
    """Four stages on DGX A100 nodes: on ranks 0-3 (one node) every transfer is NVLink; on ranks 0, 8, 16, 24
    (a stage per node, as Megatron places pp outside tp) every transfer crosses the network, and the step grows."""
    p, m = 4, 8
    actions = [one_f_one_b(p, m, r) for r in range(p)]
    milliseconds = lambda kind, stage: 1e-3 * (F if kind == "F" else B) * 312e12 / RATE  # noqa: E731 (at bf16 peak)
    inside = lower(actions, p, p, [0, 1, 2, 3], milliseconds)
    across = lower(actions, p, p, [0, 8, 16, 24], milliseconds)
    one = estimate_stages(inside, None, "dgx-a100", ranks={r: r for r in inside}, world_size=32)
    many = estimate_stages(across, None, "dgx-a100", ranks={r: r for r in across}, world_size=32)
    links = lambda t: {s.cost.link for st in t.stages.values() for s in st.spans if s.kind == "comm"}  # noqa: E731
    assert links(one) == {"intra-node"} and links(many) == {"inter-node"}
    assert many.step_time > one.step_time
    assert sum(many.breakdown(r)["p2p"] for r in many.stages) > sum(one.breakdown(r)["p2p"] for r in one.stages)


def test_mismatched_transfers_are_named():
    p, m = 2, 2
    programs = lower([one_f_one_b(p, m, r) for r in range(p)], p, p, [0, 1], unit())
    dropped = dict(programs)
    first = next(i for i, c in enumerate(programs[1]) if isinstance(c, Collective) and c.op == "recv")
    dropped[1] = programs[1][:first] + programs[1][first + 2 :]  # the receive and its wait
    with pytest.raises(ValueError, match=r"rank 0 sends 2 message\(s\) to rank 1, which receives 1"):
        pair_transfers(dropped)
    bigger = [
        Collective(c.id, c.op, 2 * c.size_bytes, 0, 0, c.group, c.async_op, c.phase, args=c.args)
        if isinstance(c, Collective)
        else c
        for c in programs[1]
    ]
    with pytest.raises(
        ValueError, match=r"message 0 from rank 0 to rank 1: 1048576 bytes sent into a receive of 2097152"
    ):
        pair_transfers({0: programs[0], 1: bigger})
    with pytest.raises(ValueError, match=r"rank 1, which has no program here"):
        pair_transfers({0: programs[0]})
