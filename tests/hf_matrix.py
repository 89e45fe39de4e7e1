"""The Hugging Face model matrix shared by tests/test_hf_models*.py: each model as it comes, trained by every layout
and held to plain torch (the model's own forward and loss, one process, SGD), and simulated at 512 ranks.

A layout is (label, world size, strategy, options, model change): `toolkit.train.train` runs it on every rank of a
`toolkit.launch` of that world size, with the model built from its tiny config by `foreign_models.hf_model`."""

from __future__ import annotations

import functools

import foreign_models as fm
import torch

STEPS, BATCH, LR = 2, 8, 0.05
TOLERANCE = 2e-5  # fp32: only the order of sums differs (tensor-parallel partial sums, micro-batch accumulation)

# tp plans for the models that declare none (transformers' _tp_plan is empty for GPT-2, BERT and ViT); Llama,
# Mixtral and Qwen2-MoE are split by their own. GPT-2's attention is one fused c_attn (refused colwise): its MLP.
TP_PLANS = {
    "gpt2": {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"},
    "bert": {
        "bert.encoder.layer.*.attention.self.[qkv]*": "colwise",
        "bert.encoder.layer.*.output.dense": "rowwise",
        "bert.encoder.layer.*.intermediate.dense": "colwise",
    },
    "vit": {
        "vit.layers.*.attention.[qkv]_proj": "colwise",
        "vit.layers.*.attention.o_proj": "rowwise",
        "vit.layers.*.mlp.fc1": "colwise",
        "vit.layers.*.mlp.fc2": "rowwise",
    },
}
STRATEGIES = ("dp", "ddp", "zero1", "zero2", "zero3", "fsdp")


def tp(name: str, **more) -> dict:
    return dict(more, tp=2, **({"tp_plan": TP_PLANS[name]} if name in TP_PLANS else {}))


def layouts(name: str, world: int) -> list:
    """(label, strategy, options, expert_parallel: None or its options) for one model at one world size."""
    moe = name in ("mixtral", "qwen2_moe")
    if world == 2:
        rows = [(s, s, {}, None) for s in STRATEGIES]
        rows += [("tp", "local", tp(name), None), ("pp", "local", dict(pp=2, microbatches=2), None)]
        if moe:  # the experts split over the two ranks, plainly, shadowed (FasterMoE) and pipelined (Tutel)
            rows += [
                ("ep (ddp)", "ddp", {}, {}),
                ("ep + shadowing", "ddp", {}, dict(shadow=[0, 3])),
                ("ep + pipelined all-to-all", "dp", {}, dict(pipeline_degree=2)),
            ]
        return rows
    if world == 4:
        return [
            ("hsdp", "fsdp", dict(sharding_group_size=2), None),
            ("dp x pp", "ddp", dict(pp=2, microbatches=2), None),
            ("tp x pp", "local", tp(name, pp=2, microbatches=2), None),
            ("fsdp x tp", "fsdp", tp(name), None),
        ]
    if world == 8:
        return [("3D", "ddp", tp(name, pp=2, microbatches=2), None)]
    raise ValueError(world)


def build(name: str, expert_parallel: dict | None, config=None):
    model = fm.hf_model(name)
    if expert_parallel is not None:
        from toolkit.moe.hf import expert_parallel as ep

        ep(model, **expert_parallel)
    return model


def reference(name: str, losses: list | None = None) -> dict:
    """Plain torch: the model as it comes, its own forward and loss on each whole batch, SGD, one process; the
    final parameters (and each step's loss appended to `losses`)."""
    from toolkit.models.protocol import recognise

    model = fm.hf_model(name)
    data = recognise(model).data(model, vocab_size=fm.VOCAB, seq_len=fm.SEQ)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        inputs, targets = data.batch(step, BATCH)
        if name == "vit":
            loss = model(pixel_values=inputs, labels=targets).loss
        elif name == "bert":
            loss = model(input_ids=inputs, labels=targets).loss
        else:  # the targets are the next tokens already: shift_labels says so to the model's own loss
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if losses is not None:
            losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_layouts(name: str, world: int) -> dict:
    """On every rank: each layout trained STEPS steps; {label: the largest difference from plain torch, of the final
    weights and of each step's loss} on rank 0."""
    import torch.distributed as dist

    out = train_rows(name, layouts(name, world))
    return out if dist.get_rank() == 0 else None


def train_rows(name: str, rows: list) -> dict:
    from toolkit.train import TrainConfig, train

    losses = []
    expected = reference(name, losses)
    out = {}
    for label, strategy, options, ep in rows:
        config = TrainConfig(
            strategy=strategy,
            options=options,
            steps=STEPS,
            global_batch_size=BATCH,
            lr=LR,
            optimizer="sgd",
            vocab_size=fm.VOCAB,
            seq_len=fm.SEQ,
            progress=False,
            sample_memory=False,
        )
        run, state = train(config, model_fn=functools.partial(build, name, ep), return_state=True)
        if set(state) != set(expected):
            out[label] = f"keys differ: {sorted(set(state) ^ set(expected))[:4]}"
            continue
        weights = max((state[n].float() - v).abs().max().item() for n, v in expected.items())
        loss = max(abs(got - want) for (_, got), want in zip(run.metric("loss"), losses))  # each step's
        out[label] = max(weights, loss)
        out[label + " convention"] = run.meta["model"]["convention"]
        out[label + " moe"] = sorted({m["name"].rsplit("/", 1)[1] for m in run.metrics if m["name"].startswith("moe/")})
    return out


# On the simulated cluster a model costs no memory: a size at which the sharding's padding (at most one element per
# flat tensor and rank) is lost in the states, so they can be held to the formulas: about 30-60M parameters.
SIM_SIZES = {
    "gpt2": dict(vocab_size=32000, n_embd=1024, n_head=16, n_positions=256),
    "bert": dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_attention_heads=16, max_position_embeddings=256
    ),
    "vit": dict(image_size=224, patch_size=16, hidden_size=1024, intermediate_size=4096, num_attention_heads=16),
}
DECODER = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=256,
)


def sim_model(name: str):
    return fm.hf_model(name, **SIM_SIZES.get(name, DECODER))


def simulate_layouts(name: str) -> dict:
    """Every layout at 512 ranks on the simulated cluster: {label: Simulation}."""
    from toolkit.sim import simulate

    rows = [(s, s, {}) for s in STRATEGIES] + [
        ("hsdp", "fsdp", dict(sharding_group_size=8)),
        ("tp", "ddp", tp(name)),
        ("pp", "ddp", dict(pp=2, microbatches=2)),
        ("3D", "ddp", tp(name, pp=2, microbatches=2)),
    ]
    out = {}
    for label, strategy, options in rows:
        sim = simulate(
            functools.partial(sim_model, name),
            strategy,
            512,
            batch_per_rank=2,
            progress=False,
            steps=1,
            seq_len=None if name == "vit" else 128,
            **options,
        )
        out[label] = sim
    return out
