"""The tiny GPT with Mixture-of-Experts MLPs: the model that expert parallelism trains.

Every block's MLP (or every ``every``-th, as GShard and Switch alternate dense and MoE blocks) becomes
a ``toolkit.moe.MoE`` through ``GPT``'s ``mlp_factory``; the rest of the model is untouched. The
blocks add the layers' load-balancing losses to the loss (``GPTConfig.aux_loss_weight``).

Under expert parallelism the experts are split over the ranks and tagged (``param._toolkit_expert``);
everything else (embeddings, attention, norms, routers, dense MLPs) is replicated and trains with a
data-parallel strategy, which must skip the tagged parameters. Layer l's experts are seeded with
``seed + l``, so layers differ and every layout builds the same model.
"""

from __future__ import annotations

from ..moe.layer import MoE
from .gpt import GPT, MLP, GPTConfig, init_weights_


def moe_gpt(
    num_experts: int = 4,
    top_k: int = 2,
    *,
    every: int = 1,
    capacity_factor: float = 1.25,
    group=None,
    seed: int = 0,
    moe_options: dict | None = None,
    **gpt_overrides,
) -> GPT:
    """A tiny GPT (``tiny_gpt``'s defaults, ``gpt_overrides`` are GPTConfig fields) with MoE MLPs.

    every: MoE in blocks every-1, 2*every-1, ... (1 = all blocks, 2 = every other one).
    group: the expert-parallel group (default: the whole world; one process holds all experts).
    moe_options: more ``MoE`` keywords (dropless, z_loss_weight, init_std, ...).
    Seed torch first (``torch.manual_seed``): the dense weights come from torch's RNG.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int (1 = MoE in every block), got {every!r}.")
    fields = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32)
    fields.update(gpt_overrides)
    config = GPTConfig(**fields)

    def mlp(layer: int):
        if layer % every != every - 1:
            dense = MLP(config)
            init_weights_(dense)  # as the GPT initializes its own MLPs
            return dense
        return MoE(
            config.d_model,
            config.d_ff,
            num_experts,
            top_k=top_k,
            capacity_factor=capacity_factor,
            group=group,
            seed=seed + layer,
            name=f"layer{layer}",
            **(moe_options or {}),
        )

    return GPT(config, mlp_factory=mlp)
