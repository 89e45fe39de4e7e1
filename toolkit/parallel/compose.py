"""Model parallelism composed with data parallelism: a model wrapped for a dp x pp x cp x tp layout.

    model, opt = toolkit.parallel.wrap(model, "fsdp", tp=2, pp=2, microbatches=4)   # world 8: dp 2
    model, opt = toolkit.parallel.wrap(model, "ddp", cp=2, tp=2)                    # world 8: dp 2 x cp 2 x tp 2

The steps, in the order they are taken (each one a room of its own, each told only the group it needs):

1. the layout: a ("dp", "pp", "cp", "tp") DeviceMesh over the world, its ranks in `order` (Megatron's
   "tp-cp-ep-dp-pp" by default: pp outermost; `mesh.py`);
2. tensor parallelism (`tensor/`): the model's Linear/Embedding layers named by a plan are replaced, in
   place, by their split forms over the "tp" group (Megatron's column/row-parallel layers);
3. context parallelism (`context/`): the model's attention is replaced by ring attention or Ulysses over the
   "cp" group, and its ends keep this rank's tokens of each sequence;
4. pipeline parallelism (`pipeline/`): the model is cut into stages and this rank keeps its own over the
   "pp" group;
5. data parallelism: `strategy` (local, dp, ddp, zero1-3, fsdp) wraps what this rank holds and reduces,
   or shards, over the "dp" x "cp" group (the cp ranks hold the same parameters and see other tokens:
   torchtitan's FSDP shards over dp x cp the same way); an MoE layer's experts are split over ep ranks
   carved from dp x cp x tp, Megatron's way, and their copies averaged over the rest (`expert_layout.py`,
   checked before step 2);
6. under pp > 1 the pipeline's schedule drives the step: `model.forward_backward(x, y)`.

The data-parallel strategies never learn about the other dimensions: they are given a smaller group.
"""

from __future__ import annotations

from . import expert_layout
from . import mesh as mesh_

# option -> default. Present in a wrap call, they send it here.
MODEL_PARALLEL = {
    "tp": 1,
    "sequence_parallel": False,
    "tp_comm_overlap": False,
    "tp_plan": None,
    "pp": 1,
    "microbatches": None,
    "schedule": "1f1b",
    "virtual_stages": 1,
    "pp_split": None,
    "cp": 1,
    "cp_attention": "ring",
    "ep": None,  # expert parallelism's size, carved from dp x cp x tp (expert_layout.py); None: the model's own
    "order": mesh_.ORDER,
}


def wants(options: dict) -> bool:
    """True when a wrap call names any model-parallel option."""
    return any(k in options for k in MODEL_PARALLEL)


def split_options(options: dict) -> tuple[dict, dict]:
    """(model-parallel options with their defaults, the data-parallel strategy's own options)."""
    parallel = {k: options.get(k, default) for k, default in MODEL_PARALLEL.items()}
    return parallel, {k: v for k, v in options.items() if k not in MODEL_PARALLEL}


def wrap(model, strategy: str, build, optimizer, options: dict):
    """`build(model, optimizer, **options)` (the strategy's wrap) under the layout the options ask for."""
    mp, options = split_options(options)
    check_tensor_options(mp)
    check_context_options(mp, strategy)
    if mp["cp"] > 1:
        from .context.model import check

        check(model, mp["cp_attention"], mp["cp"], mp["tp"])
    mesh = mesh_.build(tp=mp["tp"], pp=mp["pp"], cp=mp["cp"], order=mp["order"])
    layout = mesh_.layout_of(mesh)
    experts_copied = expert_layout.check(model, layout, strategy, mp["ep"])  # ep: carved from dp x cp x tp
    if strategy == "local" and layout.dp > 1:
        raise ValueError(
            f"strategy 'local' means no data parallelism (dp = 1), but the world of {layout.world_size} "
            f"ranks with tp={layout.tp}, pp={layout.pp}, cp={layout.cp} leaves dp = {layout.dp}: name a "
            f"data-parallel strategy (dp, ddp, zero1-3, fsdp), or launch tp x pp x cp = "
            f"{layout.tp * layout.pp * layout.cp} ranks."
        )
    if mp["tp"] > 1 or mp["sequence_parallel"] or mp["tp_plan"] is not None:
        from .tensor import parallelize

        model = parallelize(
            model,
            mesh,
            plan=mp["tp_plan"],
            sequence_parallel=mp["sequence_parallel"],
            comm_overlap=mp["tp_comm_overlap"],
        )
    if layout.cp > 1:
        from .context import parallelize as parallelize_context

        model = parallelize_context(model, mesh_.group(mesh, "cp"), mp["cp_attention"])
    if strategy != "local":
        options = dict(options, group=mesh_.group(mesh, "dp", "cp"))
    if experts_copied is not None:  # ep < dp x cp x tp: the experts' copies are averaged too
        options = dict(options, expert_group=experts_copied)
    if layout.pp > 1:  # the pipeline wraps each stage with `build`, and joins its tp pieces itself
        from .pipeline import wrap as wrap_pipeline

        wrapped, opt = wrap_pipeline(model, mesh, build, optimizer, options, **_pipeline_options(mp))
    else:
        wrapped, opt = build(model, optimizer, **options)
    wrapped.mesh = mesh
    if hasattr(model, "context"):
        wrapped.context = model.context
    if hasattr(model, "tensor_parallel") and layout.pp == 1:
        join_tensor_parallel(wrapped, model.tensor_parallel, mesh)
    return wrapped, opt


def check_context_options(mp: dict, strategy: str) -> None:
    """Context-parallel options that make no sense are refused before any group exists."""
    from .context import ATTENTIONS

    if mp["cp_attention"] not in ATTENTIONS:
        raise ValueError(
            f"cp_attention={mp['cp_attention']!r} is not one of {ATTENTIONS}: 'ring' (zigzag-balanced "
            f"ring attention), 'ring-unbalanced' (contiguous split, for comparison), 'ulysses' "
            f"(all-to-all to a head split)."
        )
    if mp["cp"] > 1 and strategy == "local":
        raise ValueError(
            f"cp={mp['cp']} gives each rank other tokens of the same sequences with the same parameters, "
            f"so their gradients must be averaged over the cp ranks, and strategy 'local' averages "
            f"nothing: name a data-parallel strategy (dp, ddp, zero1-3, fsdp), which reduces over "
            f"dp x cp (with dp = 1 too)."
        )


def check_tensor_options(mp: dict) -> None:
    """Tensor-parallel options that make no sense are refused before any group exists."""
    if not isinstance(mp["sequence_parallel"], bool):
        raise ValueError(f"sequence_parallel must be True or False, got {mp['sequence_parallel']!r}.")
    if not isinstance(mp["tp_comm_overlap"], bool) and mp["tp_comm_overlap"] != "backward":
        raise ValueError(
            f"tp_comm_overlap must be True (TransformerEngine's rings), \"backward\" (Megatron-LM's overlap of the "
            f"column layers' backward collectives) or False, got {mp['tp_comm_overlap']!r}."
        )
    if mp["tp_comm_overlap"] is True and not mp["sequence_parallel"]:
        raise ValueError(
            "tp_comm_overlap=True hides sequence parallelism's all-gathers and reduce-scatters behind the GEMMs, "
            "a chunk of the sequence at a time, so it needs sequence_parallel=True with tp > 1 (e.g. tp=2), as "
            'Megatron\'s --tp-comm-overlap needs --sequence-parallel; tp_comm_overlap="backward" works without it.'
        )
    if mp["sequence_parallel"] and mp["tp"] == 1:
        raise ValueError(
            "sequence_parallel=True splits the sequence over the tensor-parallel ranks, so it needs "
            "tp > 1 (e.g. tp=2); with tp=1 there is nothing to split."
        )


def join_tensor_parallel(wrapped, info, mesh) -> None:
    """What the data-parallel strategy cannot know about the tensor-parallel ranks beside it:

    - its gradient clipping must count every piece of the gradient once (`tensor/clip.py`);
    - under fp16, an overflow in one tensor-parallel rank's piece must skip the step on every rank of the
      world, so the loss scaler's found-inf vote is taken over the world, not over the dp group;
    - `full_state_dict` and checkpoints join the tensor-parallel pieces (`model.tensor_parallel`).
    """
    import functools

    from .tensor.clip import clip_grad_norm_

    wrapped.tensor_parallel = info
    wrapped.clip_grad_norm_ = functools.partial(clip_grad_norm_, wrapped, info, mesh_.data_parallel_rank(mesh))
    scaler = getattr(wrapped, "scaler", None)
    if scaler is not None:
        scaler.group, scaler.across_ranks = None, True


def _pipeline_options(mp: dict) -> dict:
    return {k: mp[k] for k in ("microbatches", "schedule", "virtual_stages", "pp_split")}
