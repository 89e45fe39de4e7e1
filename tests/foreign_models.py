"""Models the toolkit did not write, for the any-model tests: torch's own nn.TransformerEncoder as a
causal language model, and (when transformers is installed) Hugging Face's GPT2LMHeadModel.

Each comes with `loss(model, x, y)`: how the plain training loop calls it (HF's forward takes keyword
arguments and returns an output object whose `.loss` is the loss)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, D_MODEL = 64, 32, 32


class ReadsChildWeight(nn.Module):
    """A parent that uses its child's weight without calling the child: what ZeRO-3's per-module gathering
    cannot see (torch's MultiheadAttention does it with out_proj; the toolkit knows that one)."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(x, self.child.weight).sum()


class ScalesByChildWeight(ReadsChildWeight):
    """The same mistake where the arithmetic works on whatever it reads: between uses ZeRO-3's parameter is this
    rank's piece of it, and the sum of a piece is a number. Only its gradient shows the mistake."""

    def forward(self, x):
        return (x * self.child.weight.sum()).sum()


class EncoderLM(nn.Module):
    """nn.TransformerEncoder as a causal LM: the head is tied to the embedding (one Parameter, two users),
    the causal mask is a buffer, and the first encoder layer runs twice per forward (weight sharing across
    depth, as ALBERT does): a module called twice."""

    def __init__(self, vocab=VOCAB, seq=SEQ, d_model=D_MODEL, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x, y=None):
        t = x.shape[1]
        mask = self.mask[:t, :t]
        h = self.encoder(self.embed(x) + self.pos[:t], mask=mask, is_causal=True)
        h = self.encoder.layers[0](h, src_mask=mask, is_causal=True)  # the same layer, again
        logits = self.head(self.norm(h))
        if y is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def encoder_lm() -> EncoderLM:
    torch.manual_seed(0)
    return EncoderLM()


def encoder_loss(model, x, y):
    return model(x, y)


def gpt2_lm():
    """Hugging Face's GPT-2 built from a config (nothing downloaded), dropout off; None without transformers."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=D_MODEL,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def gpt2_loss(model, x, y):
    return model(input_ids=x, labels=y).loss  # keyword arguments in, an output object out


# --- Hugging Face models as they come, tiny and random (nothing downloaded) ------------------------------------
# One per family the toolkit knows how to pipeline; dropout off so every layout can be held to one process.
def _hf_configs():
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=2 * D_MODEL,
        num_hidden_layers=2,
        max_position_embeddings=SEQ,
    )
    decoder = dict(common, num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    return {
        "gpt2": (
            tf.GPT2Config,
            tf.GPT2LMHeadModel,
            dict(
                vocab_size=VOCAB,
                n_positions=SEQ,
                n_embd=D_MODEL,
                n_layer=2,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, decoder),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(decoder, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": (
            tf.Qwen2MoeConfig,
            tf.Qwen2MoeForCausalLM,
            dict(
                decoder,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=D_MODEL,
                shared_expert_intermediate_size=2 * D_MODEL,
            ),
        ),
        "bert": (
            tf.BertConfig,
            tf.BertForMaskedLM,
            dict(common, num_attention_heads=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        ),
        "vit": (
            tf.ViTConfig,
            tf.ViTForImageClassification,
            dict(
                image_size=16,
                patch_size=4,
                num_channels=3,
                hidden_size=D_MODEL,
                intermediate_size=2 * D_MODEL,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_labels=5,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
        ),
    }


HF_MODELS = ("gpt2", "llama", "mixtral", "qwen2_moe", "bert", "vit")


def hf_config(name: str, **overrides):
    config_class, _, fields = _hf_configs()[name]
    return config_class(**{**fields, **overrides})


def hf_model(name: str, seed: int = 0, **overrides):
    """Hugging Face model `name` (HF_MODELS) from its tiny config, random weights seeded by `seed`."""
    _, model_class, _ = _hf_configs()[name]
    config = hf_config(name, **overrides)
    torch.manual_seed(seed)
    return model_class(config)
