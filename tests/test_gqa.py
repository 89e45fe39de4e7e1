"""Grouped-query attention (Ainslie et al. 2023; Llama 2 70B, Llama 3): n_kv_head key-value heads, each shared by
n_head/n_kv_head query heads.

- One process: the GPT's attention equals the computation written out by hand with each K and V head repeated
  for its group (transformers' `repeat_kv`), its parameters are what `gpt_parameter_split` counts, and a bad
  n_kv_head is refused in GPTConfig's words.
"""

from __future__ import annotations

import math

import pytest
import torch

from toolkit.memory import gpt_parameter_split
from toolkit.models import GPTConfig, tiny_gpt

GQA = dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2)


def test_attention_equals_the_hand_computation_with_each_kv_head_repeated_for_its_group():
    torch.manual_seed(0)
    model = tiny_gpt(**GQA)
    attn, x = model.blocks[0].attn, torch.randn(2, 16, 64, dtype=torch.float64)
    attn.double()
    w, b = attn.qkv.weight, attn.qkv.bias
    assert w.shape == (64 + 2 * 2 * 16, 64)  # q: 4 heads of 16; k and v: 2 heads each
    q, k, v = (x @ w[rows].T + b[rows] for rows in (slice(0, 64), slice(64, 96), slice(96, 128)))
    heads = []
    for head in range(4):
        group = head // 2  # query heads 0, 1 share key-value head 0; 2, 3 share head 1
        qh, kh, vh = (
            q[..., 16 * head : 16 * head + 16],
            k[..., 16 * group : 16 * group + 16],
            v[..., 16 * group :][..., :16],
        )
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(16)
        scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ vh)
    expected = torch.cat(heads, dim=-1) @ attn.proj.weight.T + attn.proj.bias
    assert (attn(x) - expected).abs().max() < 1e-12


def test_parameters_are_what_the_formula_counts_and_a_bad_group_is_refused():
    for fields in (GQA, dict(GQA, n_kv_head=1), dict(GQA, n_kv_head=None)):
        model = tiny_gpt(**fields)
        c = model.config
        counts = gpt_parameter_split(c.vocab_size, c.seq_len, c.n_layer, c.d_model, kv_hidden=c.kv_width)
        assert sum(counts.values()) == sum(p.numel() for p in model.parameters()), fields
    assert GPTConfig(n_head=4, d_model=64).n_kv_head == 4  # unset: one key-value head per query head
    with pytest.raises(ValueError, match=r"n_head=4 .* n_kv_head=3 .* valid n_kv_head for this n_head: \[1, 2, 4\]"):
        GPTConfig(n_head=4, d_model=64, n_kv_head=3)
