"""A tiny GPT (dense, or with a pluggable MLP such as MoE) and a synthetic corpus made in code."""

from .corpus import SyntheticCorpus
from .gpt import GPT, Block, GPTConfig


def tiny_gpt(mlp_factory=None, **overrides) -> GPT:
    """A small GPT that matches ``SyntheticCorpus()``'s defaults (vocab 64, seq_len 32).

    ``overrides`` are GPTConfig fields, e.g. ``tiny_gpt(n_layer=1, d_model=48, n_head=3)``.
    Seed first (``torch.manual_seed``) for reproducible weights.
    """
    fields = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32)
    fields.update(overrides)
    return GPT(GPTConfig(**fields), mlp_factory=mlp_factory)


__all__ = ["GPTConfig", "GPT", "Block", "SyntheticCorpus", "tiny_gpt"]
from .moe_gpt import moe_gpt  # noqa: E402  (after tiny_gpt: the MoE variant)

__all__ += ["moe_gpt"]
