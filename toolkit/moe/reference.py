"""The oracle: what an expert-parallel MoE layer must compute, by brute force in one process."""

from __future__ import annotations


def reference_moe(layer, chunks):
    """Brute force, one process, all experts: what an expert-parallel run over len(chunks) ranks computes.

    ``chunks[r]`` are rank r's tokens; each chunk is gated on its own (capacity is per rank), then
    every expert loops over the tokens that chose it. No sorting, no all-to-all: an independent path
    to check the layer's against. Returns (outputs per chunk, aux losses per chunk).
    """
    if layer.num_local != layer.num_experts:
        raise ValueError(
            "reference_moe needs a layer that holds every expert: build it in one process "
            "(no process group), with the same seed."
        )
    outputs, losses = [], []
    for x in chunks:
        tokens = x.reshape(-1, layer.d_model)
        r = layer.gate(tokens)
        y = tokens.new_zeros(tokens.shape)
        for e in range(layer.num_experts):
            t, j = ((r.expert_index == e) & r.kept).nonzero(as_tuple=True)
            y = y.index_add(0, t, layer.experts.expert(e, tokens[t]) * r.gate_weight[t, j, None])
        outputs.append(y.reshape(x.shape))
        losses.append(r.loss)
    return outputs, losses
