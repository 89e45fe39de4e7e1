"""Context parallelism trains what one process trains, talks only to its ring neighbours, and the simulator agrees.

- Attention: ring attention (zigzag and contiguous) and Ulysses at cp 2 and 4 equal full attention on the whole
  sequence, output and gradients of q, k and v, causal and not (fp64: to 1e-12).
- The ring's traffic: forward, each rank sends its keys and values cp-1 times, (cp-1)/cp of the whole sequence's
  K and V; backward, the keys and values again and their gradient (fp32, as accumulated): 2(cp-1)/cp of them;
  only to the next rank, only from the previous one.
- Training: every variant at cp 2, and cp composed with every data-parallel strategy, ddp x tp and pp, against
  "local" on one process (losses and final parameters, the tolerances tests/test_pipeline.py derives: a split
  only reorders sums).
- The simulator runs the same code on the fake group: its bytes per phase and model states equal the real runs'
  exactly at world 2 and 4, its activations after forward within 1% (the simulator counts the allocator's
  512-byte blocks, the real meter the tensors' bytes), and its program overlaps each pass with attention.
"""

from __future__ import annotations

import functools

import pytest
import torch
from cp_rank_checks import BASE, BATCH, SMALL, activations_per_block, attention_errors, ring_traffic, trained

import toolkit
from toolkit.memory import activation_terms, ring_bytes_per_layer, ulysses_bytes_per_layer
from toolkit.models import tiny_gpt
from toolkit.parallel.context import SequenceSplit, block, merge
from toolkit.parallel.context.model import check
from toolkit.parallel.context.ring_attention import part
from toolkit.sim import simulate
from toolkit.sim.program import Collective, Compute, Wait
from toolkit.train import TrainConfig, train

LOSS_ATOL, PARAM_ATOL = 1e-4, 1e-5  # derived in tests/test_pipeline.py: a split changes only the order of sums
FOUR = dict(SMALL, n_layer=4)
CASES = {  # (name, TrainConfig fields): world 2 is cp 2; world 4 is dp 2 x cp 2 or cp 2 x (tp 2 or pp 2)
    2: [
        ("ring", dict(strategy="ddp", global_batch_size=BATCH, options={"cp": 2})),
        ("ulysses", dict(strategy="ddp", global_batch_size=BATCH, options={"cp": 2, "cp_attention": "ulysses"})),
    ],
    4: [
        (
            "ring-unbalanced",
            dict(strategy="ddp", global_batch_size=2 * BATCH, options={"cp": 2, "cp_attention": "ring-unbalanced"}),
        ),
        ("fsdp x cp", dict(strategy="fsdp", global_batch_size=2 * BATCH, options={"cp": 2})),
        ("ddp x cp x tp", dict(strategy="ddp", clip=0.05, global_batch_size=BATCH, options={"cp": 2, "tp": 2})),
        (
            "pp x cp",
            dict(strategy="ddp", model=FOUR, global_batch_size=BATCH, options={"cp": 2, "pp": 2, "microbatches": 2}),
        ),
        *(
            (f"{s} x cp", dict(strategy=s, global_batch_size=2 * BATCH, options={"cp": 2}))  # the rest compose too
            for s in ("dp", "zero1", "zero2", "zero3")
        ),
    ],
}
SIMULATED = {"ring", "ulysses", "fsdp x cp", "ddp x cp x tp"}  # pp's step is the pipeline's: tests/test_sim_pipeline


# --- one process: the pieces ---------------------------------------------------------------------------------------
def test_zigzag_gives_rank_i_chunks_i_and_its_mirror():
    assert [SequenceSplit(4, r).chunks() for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert SequenceSplit(2, 0).positions(8).tolist() == [0, 1, 6, 7]
    assert SequenceSplit(2, 1).positions(8).tolist() == [2, 3, 4, 5]
    assert SequenceSplit(2, 1, zigzag=False).positions(8).tolist() == [4, 5, 6, 7]
    x = torch.arange(24).reshape(1, 24)
    for zigzag in (True, False):
        split = SequenceSplit(3, 0, zigzag)
        pieces = [SequenceSplit(3, r, zigzag).local(x) for r in range(3)]
        assert torch.equal(split.whole(pieces), x)
        assert [p[0].tolist() for p in pieces] == [SequenceSplit(3, r, zigzag).positions(24).tolist() for r in range(3)]


def test_the_merge_rule_on_numbers():
    # one query; keys of block 1 score 0 and ln 3 (values 1 and 5), block 2 scores ln 2 (value 11): softmax over
    # all three is (1, 3, 2)/6, so the output is (1·1 + 3·5 + 2·11)/6 = 38/6
    out1, lse1 = torch.tensor([[[[(1 + 3 * 5) / 4]]]]), torch.tensor([[[torch.log(torch.tensor(4.0))]]])
    out2, lse2 = torch.tensor([[[[11.0]]]]), torch.tensor([[[torch.log(torch.tensor(2.0))]]])
    out, lse = merge(out1, lse1, out2, lse2)
    assert out.item() == pytest.approx(38 / 6) and lse.exp().item() == pytest.approx(6)
    torch.manual_seed(0)  # and any split of the keys, merged in any order, is attention over all of them
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    full, full_lse = block.attend(q, k, v, False)
    parts = [block.attend(q, k[:, :, i:j], v[:, :, i:j], False) for i, j in ((3, 5), (0, 1), (1, 3))]
    out, lse = parts[0]
    for part_out, part_lse in parts[1:]:
        out, lse = merge(out, lse, part_out, part_lse)
    assert torch.allclose(out, full, atol=1e-14) and torch.allclose(lse, full_lse, atol=1e-14)


def test_zigzag_balances_causal_work_and_a_contiguous_split_does_not():
    def work(cp, zigzag, length=8):  # query-key pairs each rank attends over the cp steps (causal blocks: half)
        total = []
        for me in range(cp):
            pairs = 0
            for owner in range(cp):
                p = part(me, owner, length, True, zigzag)
                if p is not None:
                    rows = len(range(length)[p.queries]) * len(range(length)[p.keys])
                    pairs += rows // 2 if p.causal else rows
            total.append(pairs)
        return total

    assert work(4, zigzag=True) == [4 * 32] * 4  # every rank: the same
    assert work(4, zigzag=False) == [32, 96, 160, 224]  # rank r: 2r + 1 halves of a block
    assert part(1, 0, 8, False, True).queries == slice(None)  # no mask: everything, every step


def test_a_block_without_the_fused_kernel_is_the_same_attention():
    """Elsewhere than CPU (and meta), the block's attention is plain tensor algebra: the same numbers."""
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(2, 3, 6, 4, dtype=torch.float64) for _ in range(4))
    for causal in (True, False):
        out, lse = block.fused_attend(q, k, v, causal, None)
        plain, plain_lse = block.plain_attend(q, k, v, causal, None)
        assert torch.allclose(out, plain, atol=1e-12) and torch.allclose(lse, plain_lse, atol=1e-12)
        for a, b in zip(
            block.fused_attend_backward(g, q, k, v, out, lse, causal, None),
            block.plain_attend_backward(g, q, k, v, out, lse, causal, None),
        ):
            assert torch.allclose(a, b, atol=1e-12)


def test_bad_input_is_refused_before_training():
    with pytest.raises(ValueError, match=r"2·cp = 4 chunks.*length of 30 tokens does not split.*multiple of 4"):
        TrainConfig(strategy="ddp", seq_len=30, options={"cp": 2}).check_world(2)
    TrainConfig(strategy="ddp", seq_len=30, options={"cp": 2, "cp_attention": "ring-unbalanced"}).check_world(2)
    with pytest.raises(ValueError, match=r"Ulysses.*'blocks.0.attn' has 4 heads.*over 8 ranks.*among \[1, 2, 4\]"):
        check(tiny_gpt(n_head=4), "ulysses", 8)
    with pytest.raises(ValueError, match=r"its share on each of tp=2 ranks\) has 2 heads.*over 4 ranks"):
        check(tiny_gpt(n_head=4), "ulysses", 4, tp=2)
    check(tiny_gpt(n_head=4), "ring", 8)  # the ring has no limit on heads
    with pytest.raises(ValueError, match=r"'blocks.0.attn' has attention_dropout=0.1.*attention_dropout=0"):
        check(tiny_gpt(attention_dropout=0.1), "ring", 2)
    with pytest.raises(ValueError, match=r"cannot find it: no module with an attend\(q, k, v\) method"):
        toolkit.parallel.wrap(torch.nn.Sequential(torch.nn.Embedding(8, 4)), "ddp", cp=2)
    with pytest.raises(ValueError, match=r"strategy 'local' averages nothing"):
        toolkit.parallel.wrap(tiny_gpt(), "local", cp=2)
    with pytest.raises(ValueError, match=r"cp_attention='rings' is not one of"):
        toolkit.parallel.wrap(tiny_gpt(), "ddp", cp=2, cp_attention="rings")


def test_the_simulated_ring_overlaps_each_pass_with_a_blocks_attention():
    """In the recorded program of a forward, each pass (send and receive, asynchronous) is issued before the
    attention of the block in hand and waited for after it: the overlap, as the rank issued it."""
    sim = simulate(lambda: tiny_gpt(**SMALL), "ddp", 8, rank=5, cp=4, batch_per_rank=1, progress=False)
    forward = [i for i in sim.programs[0] if i.phase == "forward"]
    sends = [n for n, i in enumerate(forward) if isinstance(i, Collective) and i.op == "send"]
    assert len(sends) == SMALL["n_layer"] * 3 and all(forward[n].async_op for n in sends)  # cp - 1 per layer
    for n in sends:
        wait = next(
            m for m in range(n, len(forward)) if isinstance(forward[m], Wait) and forward[m].id == forward[n].id
        )
        between = [i for i in forward[n:wait] if isinstance(i, Compute)]
        assert any(kernel.kind == "attention" for c in between for kernel, _ in c.kernels), n
    peers = {i.args["peer"] for i in forward if isinstance(i, Collective) and i.op in ("send", "recv")}
    assert peers == {4, 6}  # cp group [4, 5, 6, 7] (tp 1: cp varies fastest in Megatron's order): neighbours only


def test_the_simulated_ring_and_ulysses_send_what_the_formulas_say():
    """Per layer and rank: the ring (cp-1)/cp of K and V forward and twice that backward (K and V again, and their
    gradient); Ulysses (cp-1)/cp of its q, k, v and output each way. At tp 2 the K and V are a tp rank's heads."""
    b, s, h, L = 2, 32, SMALL["d_model"], SMALL["n_layer"]
    for cp, tp, attention in ((4, 1, "ring"), (2, 2, "ring"), (4, 1, "ulysses"), (2, 2, "ulysses")):
        sim = simulate(
            lambda: tiny_gpt(**SMALL),
            "ddp",
            4,
            rank=3,
            cp=cp,
            tp=tp,
            cp_attention=attention,
            batch_per_rank=b,
            progress=False,
        )
        sent = {}
        for c in sim.collectives():
            if c.args.get("cp") in ("kv", "dkv", "ulysses"):
                sent[c.phase] = sent.get(c.phase, 0) + c.bytes_sent
        formula = (ring_bytes_per_layer if attention == "ring" else ulysses_bytes_per_layer)(
            b, s, h, cp, tp=tp, bytes_per_value=4
        )
        assert sent == {"forward": L * formula["forward"], "backward": L * formula["backward"]}, (cp, tp, attention)
        assert sim.bytes_per_step["total"] == sim.theory()["bytes_per_step"], (cp, tp, attention)  # and the rest
    recomputed = (dict(cp=2, activation_checkpointing=k) for k in (True, 2))  # every block; every second one
    for options in (dict(cp=4, mixed_precision=True), *recomputed):  # bf16; recompute
        sim = simulate(lambda: tiny_gpt(**SMALL), "fsdp", 4, rank=3, batch_per_rank=b, progress=False, **options)
        assert sim.bytes_per_step["total"] == sim.theory()["bytes_per_step"], options


# --- real ranks: one launch per world size --------------------------------------------------------------------------
def on_ranks(world: int) -> dict:
    found = {"trained": trained(CASES[world])}
    if world == 2:
        found["activations"] = {a: activations_per_block(a) for a in ("ring", "ring-unbalanced", "ulysses")}
    if world == 4:
        found["attention"] = {size: attention_errors(size) for size in (2, 4)}
        found["traffic"] = ring_traffic(4)
    return found


@functools.cache
def launched(world: int):
    return toolkit.launch(on_ranks, world, args=(world,), timeout_s=300, quiet=True)


def reference(fields):
    torch.manual_seed(0)
    run, state = train(
        TrainConfig(**{**BASE, **{k: v for k, v in fields.items() if k != "options"}, "strategy": "local"}),
        return_state=True,
    )
    return [m["value"] for m in run.metrics if m["name"] == "loss"], state


@pytest.mark.timeout(400)
def test_ring_and_ulysses_equal_full_attention_and_the_ring_talks_only_to_neighbours(no_leftover_ranks):
    got = launched(4)
    for size, errors in got[0]["attention"].items():
        assert max(errors.values()) < 1e-12, (size, errors)
    for r, found in enumerate(got):
        traffic = found["traffic"]
        kv, cp = traffic["kv_bytes"], 4  # this rank's K and V: 1/cp of the whole sequence's
        assert traffic["sent"] == {
            ("forward", "kv"): (cp - 1) * kv,
            ("backward", "kv"): (cp - 1) * kv,
            ("backward", "dkv"): (cp - 1) * kv,
        }, r
        assert traffic["peers"] == {("send", traffic["next"]), ("recv", traffic["previous"])}, r


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_every_variant_and_composition_trains_as_one_process_and_the_simulator_agrees(world, no_leftover_ranks):
    got = launched(world)
    for name, fields in CASES[world]:
        losses, state = reference(fields)
        mine = got[0]["trained"][name]
        assert max(abs(a - b) for a, b in zip(mine["losses"], losses)) <= LOSS_ATOL, (name, mine["losses"], losses)
        assert set(mine["state"]) == set(state), name
        worst = max((mine["state"][k] - state[k]).abs().max().item() for k in state)
        assert worst <= PARAM_ATOL, (name, worst)
        if name not in SIMULATED:
            continue
        rank = world - 1
        measured = got[rank]["trained"][name]
        sim = simulate(
            lambda: tiny_gpt(**SMALL),
            fields["strategy"],
            world,
            rank=rank,
            batch_per_rank=BATCH,
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            progress=False,
            **fields["options"],
        )
        real = dict(measured["bytes"])
        if "clip" in fields:  # the real run clips (one fp32 all-reduce over the world); the simulated step does not
            assert real.pop("optimizer") == 2 * (world - 1) * 4 // world, name
            real["total"] -= 2 * (world - 1) * 4 // world
        assert sim.bytes_per_phase == real, name
        assert {k: sim.memory[k] for k in measured["states"]} == measured["states"], name
        after_forward = next(s["activations"] for s in sim.samples if s["phase"] == "forward")
        assert abs(after_forward - measured["activations"]) <= 0.01 * measured["activations"], (
            name,
            after_forward,
            measured["activations"],
        )


@pytest.mark.timeout(400)
def test_activations_per_rank_are_korthikantis_terms_at_s_over_cp(no_leftover_ranks):
    """Each block on a cp rank keeps what one process keeps for a sequence cp times shorter (this GPT's terms:
    fp32, no dropout, a fused attention's output and log-sum-exp)."""
    s, h = 32 // 2, SMALL["d_model"]
    terms = activation_terms(
        s, BATCH, h, SMALL["n_head"], bytes_per_value=4, dropout=False, fused_attention=True, small_terms=True
    )
    for found in launched(2):
        found = found["activations"]
        assert found["ring"] == found["ring-unbalanced"] == [sum(terms.values())] * SMALL["n_layer"]
        # Ulysses keeps the attention's output twice: in the head split for the kernel, in the sequence split for
        # the projection (the ring's output is both at once)
        assert found["ulysses"] == [sum(terms.values()) + 4 * s * BATCH * h] * SMALL["n_layer"]
