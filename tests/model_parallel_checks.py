"""What the world-4 launch of tests/test_model_parallel.py checks on every rank besides training, one function per
behaviour, each returning plain values that the test asserts (the launch runs them all, once)."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import toolkit
from toolkit.memory import ledger
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.trace.events import recorder

ADAM = functools.partial(torch.optim.AdamW, lr=1e-2)


def _sent(events, name=None) -> int:
    return sum(e["args"]["bytes_sent"] for e in events if e["cat"] == "comm" and name in (None, e["name"]))


def embedding_bytes() -> dict:
    """{sequence_parallel: (bytes sent by the embedding's forward, by its backward)} at tp = world, the tiny GPT's
    embed() alone (token lookup, positions, and under sequence parallelism this rank's positions of them)."""
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model, _ = toolkit.parallel.wrap(tiny_gpt(n_head=4), "local", tp=dist.get_world_size(), sequence_parallel=sp)
        x, _ = SyntheticCorpus().batch(0, 8)
        recorder.reset()
        h = model.module.embed(x)
        forward = _sent(recorder.events)
        recorder.reset()
        h.pow(2).sum().backward()
        out[sp] = (forward, _sent(recorder.events))
    return out


def _sequence_or_ring(label: str) -> bool:
    return label.startswith(("sequence", "column", "row"))


def tp_ring_traffic() -> dict:
    """{tp_comm_overlap: (bytes sent by the layers' tensor-parallel calls in one step, {(op, label): calls})} at
    tp = world with sequence parallelism: the rings move what the blocking all-gathers and reduce-scatters move."""
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model, opt = toolkit.parallel.wrap(
            tiny_gpt(n_head=4), "local", tp=dist.get_world_size(), sequence_parallel=True, tp_comm_overlap=overlap
        )
        x, y = SyntheticCorpus().batch(0, 8)
        recorder.reset()
        model(x, y).backward()
        layers = [e for e in recorder.events if e["cat"] == "comm" and _sequence_or_ring(e["args"].get("tp", ""))]
        calls: dict = {}
        for e in layers:
            key = (e["name"], e["args"]["tp"])
            calls[key] = calls.get(key, 0) + 1
        out[overlap] = (_sent(layers), calls)
    return out


def cross_entropy_backward_memory(tokens: int = 256, width: int = 512, hidden: int = 8) -> tuple[int, int]:
    """(bytes the vocabulary-parallel loss's backward allocates at its peak, through the head's matmul, measured by
    torch's MemTracker; one (tokens, V/t) fp32 buffer's bytes). The softmax the forward saved becomes the
    gradient in place, so backward allocates only the matmul's small gradients: well under one buffer."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from toolkit.parallel.tensor import TPGroup
    from toolkit.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy

    tp = TPGroup.of(dist.group.WORLD)
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    head = torch.randn(width, hidden, requires_grad=True)
    y = torch.randint(0, width * tp.size, (tokens,))
    tracker = MemTracker()
    with tracker:  # watching from the forward on, so that the saved softmax is known before backward writes into it
        loss = vocab_parallel_cross_entropy(F.linear(h, head), y, tp)
    with tracker:  # entering again starts the peak from what is live now
        before = _total(tracker.get_tracker_snapshot("current"))
        loss.backward()
        peak = _total(tracker.get_tracker_snapshot("peak"))
    return peak - before, tokens * width * 4


def _total(snapshot: dict) -> int:
    return sum(v["Total"] for v in snapshot.values())


def rng_streams() -> tuple:
    """At dp 2 x tp 2: ((dp, tp) coordinate, 4 numbers drawn inside the tensor-parallel stream, 4 drawn outside it
    right after, whether the default stream's state came out of the fork as it went in)."""
    from toolkit.parallel.rng import tracker

    torch.manual_seed(0)
    model, _ = toolkit.parallel.wrap(tiny_gpt(), "ddp", tp=2)
    before = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(4)
    unchanged = torch.equal(before, torch.get_rng_state())
    outside = torch.rand(4)
    coordinate = (model.mesh.get_local_rank("dp"), model.mesh.get_local_rank("tp"))
    return coordinate, inside.tolist(), outside.tolist(), unchanged


def dropout_masks() -> dict:
    """{sequence_parallel: block 0's residual dropout mask on this rank} at tp = world (dropout 0.5 everywhere)."""
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model, _ = toolkit.parallel.wrap(
            tiny_gpt(n_head=4, dropout=0.5, attention_dropout=0.5),
            "local",
            tp=dist.get_world_size(),
            sequence_parallel=sp,
        )
        masks: list = []
        model.module.blocks[0].attn.resid_drop.register_forward_hook(lambda m, i, o, masks=masks: masks.append(o != 0))
        model(*SyntheticCorpus().batch(0, 8))
        out[sp] = masks[0]
    return out


def padded_vocabulary(directory: str) -> dict:
    """A vocabulary of 66 at tp 4 (padded to 68: the last rank's two last rows): trained 2 steps with AdamW, saved;
    what the padding rows and their optimizer state hold, the full state's shapes, and the checkpoint loaded at
    dp 4 (no tensor parallelism) and at dp 2 x tp 2 (66 divides: no padding), each saved again."""
    from toolkit.parallel.checkpoint import load_full, save_full

    V, rank = 66, dist.get_rank()
    torch.manual_seed(0)
    model, opt = toolkit.parallel.wrap(tiny_gpt(vocab_size=V, n_head=4), "local", optimizer=ADAM, tp=4)
    corpus = SyntheticCorpus(vocab_size=V)
    for step in range(2):
        model(*corpus.batch(step, 8)).backward()
        opt.step()
        opt.zero_grad()
    piece = model.module.tok_emb.weight
    padding = piece[V - 3 * piece.shape[0] :] if rank == 3 else piece[:0]
    moments = [s for s in opt.state[piece].values() if torch.is_tensor(s) and s.dim()] if rank == 3 else []
    found = {
        "piece rows": piece.shape[0],
        "padding zero": bool((padding == 0).all()) and padding.shape[0] == 2,
        "moments zero": all(bool((m[V - 3 * piece.shape[0] :] == 0).all()) for m in moments) and len(moments) == 2,
    }
    first = os.path.join(directory, "tp4-vocab66.pt")
    save_full(model, opt, first)
    saved = toolkit.parallel.full_state_dict(model)
    found["full shape"] = tuple(saved["tok_emb.weight"].shape)
    for strategy, options in (("ddp", {}), ("ddp", {"tp": 2})):
        torch.manual_seed(1)  # other initial values: only the checkpoint can make them equal
        other, other_opt = toolkit.parallel.wrap(tiny_gpt(vocab_size=V, n_head=4), strategy, optimizer=ADAM, **options)
        load_full(other, other_opt, first)
        again = os.path.join(directory, f"{strategy}-tp{options.get('tp', 1)}.pt")
        save_full(other, other_opt, again)
        state = toolkit.parallel.full_state_dict(other)
        found[f"loaded at tp {options.get('tp', 1)}"] = (all(torch.equal(state[k], saved[k]) for k in saved), again)
    found["file"] = first
    return found


def pipeline_sends() -> dict:
    """One step at pp 2 x tp 2 (m = 4): (pp rank, {message: bytes this rank sent}, its pipeline all-gathers' bytes)."""
    torch.manual_seed(0)
    model, _ = toolkit.parallel.wrap(tiny_gpt(n_layer=4), "local", pp=2, tp=2, microbatches=4)
    recorder.reset()
    model.forward_backward(*SyntheticCorpus().batch(0, 8))
    sends: dict = {}
    for e in recorder.events:
        if e["name"] == "send":
            sends[e["args"]["message"]] = sends.get(e["args"]["message"], 0) + e["args"]["bytes_sent"]
    gathers = sum(
        e["args"]["bytes_sent"]
        for e in recorder.events
        if e["name"] == "all_gather" and e["args"].get("tp", "").startswith("pipeline")
    )
    return model.mesh.get_local_rank("pp"), sends, gathers


def fsdp_kept_gathered() -> dict:
    """FSDP over dp 2 x pp 2, m = 4, with and without reshard_after_forward: per option, (bytes this rank all-gathered
    and reduce-scattered over its dp group in the second step, the ledger's parameter bytes after each action of
    that step, the stage's units' (padded numel, shard numel))."""
    out = {}
    for keep in (False, True):
        torch.manual_seed(0)
        model, opt = toolkit.parallel.wrap(
            tiny_gpt(n_layer=4), "fsdp", pp=2, microbatches=4, reshard_after_forward=not keep
        )
        x, y = SyntheticCorpus().batch(0, 16, rank=model.mesh.get_local_rank("dp"), world_size=2)
        params: list = []
        for step in range(2):
            if step == 1:
                recorder.reset()
                model.driver.observers.append(
                    lambda action, model=model, opt=opt, params=params: params.append(ledger(model, opt)["params"])
                )
            model.forward_backward(x, y)
            opt.step()
            opt.zero_grad()
        units = [(u["padded_numel"], u["shard_numel"]) for stage in model.stages.values() for u in stage.describe()]
        out[keep] = (_sent(recorder.events, "all_gather"), _sent(recorder.events, "reduce_scatter"), params, units)
    return out
