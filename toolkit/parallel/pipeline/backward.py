"""A backward in two halves, for zero-bubble schedules: B (the input's gradient), then W (the weights').

A linear layer y = x A^T has two gradients: dx = dy A, which the stage upstream is waiting for, and
dA = dy^T x, which nobody needs before the optimizer step. B computes every dx of the stage down to its
input (and keeps, at each weight's doorstep, the gradient that arrived there); W later finishes each
weight's gradient from what B kept. Together they cost one backward, and W can be moved into idle time.

B is torch.distributed.pipelining's `stage_backward_input` (which finds, in the autograd graph, the nodes
where the input's path meets each weight's). W is its `stage_backward_weight` with one change: the
weights' gradients are accumulated by autograd itself (`torch.autograd.backward(..., inputs=weights)`),
not assigned afterwards, so the hooks a data-parallel strategy puts on gradient accumulation (DDP's
buckets, ZeRO's reduce-scatter) fire as in any backward. The first stage's input is token ids, which
have no gradient: there B does nothing and W runs the whole backward (as torch does).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import stage_backward_input  # private: pinned here only


def backward(roots: list, grads: list) -> None:
    """The whole backward of a stage: every gradient, input's and weights'."""
    torch.autograd.backward(roots, grads)


def backward_input(roots: list, grads: list, inputs: list, weights: list) -> list:
    """B: the gradients of `inputs` (into their .grad); returns what W needs (the weights' groups)."""
    _, groups = stage_backward_input(roots, grads, inputs, iter(weights))
    return groups


def backward_weight(groups: list) -> None:
    """W: each weight's gradient from the gradients B kept where its path met the input's. One autograd call
    for every weight of the stage, so a strategy that acts at the end of a backward (DDP's last bucket, ZeRO's
    reduction) sees one backward, as it would without the split."""
    edges, grads, weights, nodes = [], [], [], []
    for group in groups:
        for kept, node in zip(group["grads"] or [], group["intermediates"]):
            nodes.append((kept, node))
            for i, g in enumerate(kept):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        weights += [GradientEdge(node, 0) for node in group["params"]]
    handles = []
    if len(nodes) > 1:  # an intermediate below another gets only what B gave it, not that again from above
        handles = [node.register_prehook(lambda _, kept=kept: kept) for kept, node in nodes]
    try:
        if edges:
            torch.autograd.backward(edges, grads, inputs=weights)
    finally:
        for h in handles:
            h.remove()
        for group in groups:
            group.clear()  # drop the kept gradients and the graph nodes
