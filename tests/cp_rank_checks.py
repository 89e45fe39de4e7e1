"""What the context-parallel tests run on real ranks: attention against full attention, the ring's traffic, and
training runs of every composition (their losses, final parameters and records, for the test to hold against
one process and against the simulator)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import toolkit
from toolkit.parallel.context import CPGroup, Ring, SequenceSplit, ring_attention, ulysses_attention
from toolkit.train import TrainConfig, train

VARIANTS = ("ring", "ring-unbalanced", "ulysses")
SMALL = dict(n_layer=2, d_model=64, n_head=4)
BASE = dict(steps=2, optimizer="sgd", lr=0.1, progress=False, model=SMALL)
BATCH = 2  # sequences per data-parallel replica


def groups_of(size: int):
    """This rank's group of `size` consecutive ranks (every rank makes every group, in the same order)."""
    mine = None
    for first in range(0, dist.get_world_size(), size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def attention_errors(size: int, dtype=torch.float64) -> dict:
    """{(variant, causal): the largest difference, over the output and the three gradients, between this rank's
    share of context-parallel attention over `size` ranks and full attention on the whole sequence}."""
    group, found = groups_of(size), {}
    cp = CPGroup.of(group)
    torch.manual_seed(0)  # every rank: the same whole sequence
    q, k, v, grad = (torch.randn(2, 4, 8 * size, 8, dtype=dtype) for _ in range(4))
    for variant in VARIANTS:
        split = SequenceSplit(cp.size, cp.rank, zigzag=variant == "ring")
        for causal in (True, False):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            F.scaled_dot_product_attention(*full, is_causal=causal).backward(grad)
            mine = [split.local(t, dim=2).requires_grad_() for t in (q, k, v)]
            if variant == "ulysses":
                y = ulysses_attention(*mine, cp, causal=causal)
            else:
                y = ring_attention(*mine, Ring(group), split, causal=causal)
            y.backward(split.local(grad, dim=2))
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            errors = [(y - split.local(expected, dim=2)).abs().max()]
            errors += [(a.grad - split.local(b.grad, dim=2)).abs().max() for a, b in zip(mine, full)]
            found[(variant, causal)] = max(e.item() for e in errors)
    return found


def ring_traffic(size: int) -> dict:
    """One layer's ring attention, forward and backward, fp32, b 2, 4 heads, s = 16·size, head_dim 8: the bytes
    this rank sent per pass and label, and every peer it sent to or received from."""
    group = groups_of(size)
    ring = Ring(group)
    split = SequenceSplit(ring.size, ring.rank)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))  # this rank's 16 tokens
    sent, peers, calls = {}, set(), []

    def count(kind, event, tensor):
        if kind == "issue" and event["name"] in ("send", "recv"):
            calls.append(event)

    with toolkit.comm.listening(count):
        y = ring_attention(q, k, v, ring, split)
        forward = len(calls)
        y.sum().backward()
    for n, event in enumerate(calls):
        key = ("forward" if n < forward else "backward", event["args"]["cp"])
        sent[key] = sent.get(key, 0) + event["args"]["bytes_sent"]
        peers.add((event["name"], event["args"]["peer"]))
    return {
        "sent": sent,
        "peers": peers,
        "next": ring.next,
        "previous": ring.previous,
        "kv_bytes": 2 * q.numel() * q.element_size(),
    }


def trained(cases) -> dict:
    """{name: (losses, final full state on rank 0, this rank's bytes per phase, model states and activations after
    forward of the last step)} for each (name, TrainConfig fields)."""
    rank, found = dist.get_rank(), {}
    for name, fields in cases:
        torch.manual_seed(0)
        run, state = train(TrainConfig(**{**BASE, **fields}), return_state=True)
        last = [s for s in run.samples if s["step"] == fields.get("steps", BASE["steps"]) - 1]
        after_backward = next((s for s in last if s["phase"] == "backward"), None)  # (under pp: no such phase)
        found[name] = {
            "losses": [m["value"] for m in run.metrics if m["name"] == "loss"],
            "state": state if rank == 0 else None,
            "bytes": toolkit.trace.analysis.bytes_per_step(run, rank)[-1],
            "states": after_backward and {k: after_backward[k] for k in ("params", "grads", "optimizer")},
            "activations": max((s["activations"] for s in last), default=None),
        }
    return found


def activations_per_block(attention: str) -> list[int]:
    """Bytes autograd keeps per block on this rank for one forward of the GPT at cp = world size."""
    from toolkit.memory import activations_by_module
    from toolkit.models import SyntheticCorpus, tiny_gpt

    torch.manual_seed(0)
    model, _ = toolkit.parallel.wrap(tiny_gpt(**SMALL), "ddp", cp=dist.get_world_size(), cp_attention=attention)
    x, y = SyntheticCorpus().batch(0, BATCH)
    return activations_by_module(model, model.module.blocks, x, y)[0]
