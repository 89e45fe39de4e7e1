"""The models the papers talk about, built from their configurations with the toolkit's own GPT.

Too big for any laptop, they are meant for the simulated cluster (`toolkit.sim`), which builds them
on the meta device: `simulate(presets.gpt3_175b, "zero3", 512)`. Each is a plain function (no
arguments needed) so it can be passed as a `model_fn`; `PRESETS` names them for the command line.

    gpt3_175b    GPT-3 175B (Brown et al. 2020): 96 layers, d_model 12288, 96 heads, vocab 50257,
                 sequence 2048: 174.6B parameters in this GPT (biases, tied head)
    zero_7_5b    a GPT-like 7.5B model for ZeRO's Figure 1 (the paper gives only Ψ): GPT-3 6.7B's width
                 (d_model 4096, 32 heads), 36 layers, vocab 50257, context 8192: 7.49B parameters,
                 which gives the figure's 120 / 31.4 / 16.6 / 1.9 GB to its precision
    gpt2_xl      GPT-2 XL: 48 layers, d_model 1600, 25 heads: 1.56B (a size a lesson can also train)
    moe_gpt_s    FasterMoE's MoE-GPT-S: 12 layers, d_model H = 1024, 16 experts of d_ff 2H, top-2: the
                 paper's L(2αE + 4)H² = 0.86B, plus embeddings and biases
    moe_gpt_64   the same with 64 experts, one per rank of a 64-rank expert-parallel cluster

`model_fn_for(name)` is what the command line builds: a preset by its name, or a Hugging Face model from a
configuration file (a `config.json`, or a folder holding one, as a model's page on the Hub has it): the model
transformers builds from it (the class its `architectures` names), random weights, nothing downloaded.
"""

from __future__ import annotations

import functools
import os

from . import tiny_gpt
from .moe_gpt import moe_gpt

GPT3 = dict(vocab_size=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288)
ZERO_7_5B = dict(vocab_size=50257, seq_len=8192, n_layer=36, n_head=32, d_model=4096)
GPT2_XL = dict(vocab_size=50257, seq_len=1024, n_layer=48, n_head=25, d_model=1600)
MOE_GPT_S = dict(vocab_size=50257, seq_len=1024, n_layer=12, n_head=16, d_model=1024, d_ff=2048)


def gpt3_175b(**overrides):
    """GPT-3 175B; `overrides` change GPTConfig fields (e.g. n_layer=2 for a quick look at one layer)."""
    return tiny_gpt(**{**GPT3, **overrides})


def zero_7_5b(**overrides):
    """The 7.5B-parameter GPT-like model of ZeRO's Figure 1."""
    return tiny_gpt(**{**ZERO_7_5B, **overrides})


def gpt2_xl(**overrides):
    return tiny_gpt(**{**GPT2_XL, **overrides})


def moe_gpt_s(num_experts: int = 16, top_k: int = 2, **overrides):
    """MoE-GPT-S (FasterMoE Table 2): every block's MLP is an expert-parallel MoE layer."""
    return moe_gpt(num_experts, top_k, **{**MOE_GPT_S, **overrides})


moe_gpt_64 = functools.partial(moe_gpt_s, 64)
moe_gpt_64.__doc__ = "MoE-GPT-S with 64 experts (one per rank at 64 ranks)."

PRESETS = {
    "gpt3-175b": gpt3_175b,
    "zero-7.5b": zero_7_5b,
    "gpt2-xl": gpt2_xl,
    "moe-gpt-s": moe_gpt_s,
    "moe-gpt-64": moe_gpt_64,
    "tiny": tiny_gpt,
}


def model_fn_for(name: str, layers: int | None = None):
    """A function that builds preset `name`, or the Hugging Face model configured by the file or folder `name`,
    with `layers` layers if given."""
    if name in PRESETS:
        build = PRESETS[name]
        return functools.partial(build, n_layer=layers) if layers else build
    if not os.path.exists(name):
        raise ValueError(
            f"--model {name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a Hugging Face "
            f"config file or folder (a config.json, as a model's page on the Hub has it)."
        )
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(
            f"--model {name!r} is a Hugging Face config; building it needs transformers: pip install -e '.[hf]'."
        ) from exc
    config = transformers.AutoConfig.from_pretrained(name)
    if layers:
        config.num_hidden_layers = layers
    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        return functools.partial(transformers.AutoModelForCausalLM.from_config, config)
    return functools.partial(model_class, config)
