"""Model parallelism composed with data parallelism: a model wrapped for a dp x pp x tp layout.

    model, opt = toolkit.parallel.wrap(model, "fsdp", tp=2, pp=2, microbatches=4)   # world 8: dp 2

The steps, in the order they are taken (each one a room of its own, each told only the group it needs):

1. the layout: a ("dp", "pp", "tp") DeviceMesh over the world (`mesh.py`);
2. tensor parallelism (`tensor/`): the model's Linear/Embedding layers named by a plan are replaced, in
   place, by their split forms over the "tp" group (Megatron's column/row-parallel layers);
3. pipeline parallelism (`pipeline/`): the model is cut into stages and this rank keeps its own over the
   "pp" group;
4. data parallelism: `strategy` (local, dp, ddp, zero1-3, fsdp) wraps what this rank holds and reduces,
   or shards, over the "dp" group only;
5. under pp > 1 the pipeline's schedule drives the step: `model.forward_backward(x, y)`.

The data-parallel strategies never learn about the other two dimensions: they are given a smaller group.
"""
from __future__ import annotations

from . import mesh as mesh_

# option -> default. Present in a wrap call, they send it here.
MODEL_PARALLEL = {"tp": 1, "sequence_parallel": False, "tp_plan": None,
                  "pp": 1, "microbatches": None, "schedule": "1f1b", "virtual_stages": 1, "pp_split": None}


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
    mesh = mesh_.build(tp=mp["tp"], pp=mp["pp"])
    layout = mesh_.layout_of(mesh)
    if strategy == "local" and layout.dp > 1:
        raise ValueError(f"strategy 'local' means no data parallelism (dp = 1), but the world of {layout.world_size} "
                         f"ranks with tp={layout.tp}, pp={layout.pp} leaves dp = {layout.dp}: name a data-parallel "
                         f"strategy (dp, ddp, zero1-3, fsdp), or launch tp x pp = {layout.tp * layout.pp} ranks.")
    if mp["tp"] > 1 or mp["sequence_parallel"] or mp["tp_plan"] is not None:
        from .tensor import parallelize

        model = parallelize(model, mesh, plan=mp["tp_plan"], sequence_parallel=mp["sequence_parallel"])
    if strategy != "local":
        options = dict(options, group=mesh_.group(mesh, "dp"))
    if layout.pp > 1:  # the pipeline wraps each stage with `build`, and joins its tp pieces itself
        from .pipeline import wrap as wrap_pipeline

        wrapped, opt = wrap_pipeline(model, mesh, build, optimizer, options, **_pipeline_options(mp))
    else:
        wrapped, opt = build(model, optimizer, **options)
    wrapped.mesh = mesh
    if hasattr(model, "tensor_parallel") and layout.pp == 1:
        join_tensor_parallel(wrapped, model.tensor_parallel, mesh)
    return wrapped, opt


def check_tensor_options(mp: dict) -> None:
    """Tensor-parallel options that make no sense are refused before any group exists."""
    if not isinstance(mp["sequence_parallel"], bool):
        raise ValueError(f"sequence_parallel must be True or False, got {mp['sequence_parallel']!r}.")
    if mp["sequence_parallel"] and mp["tp"] == 1:
        raise ValueError("sequence_parallel=True splits the sequence over the tensor-parallel ranks, so it needs "
                         "tp > 1 (e.g. tp=2); with tp=1 there is nothing to split.")


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
    wrapped.clip_grad_norm_ = functools.partial(clip_grad_norm_, wrapped, info, mesh.get_coordinate()[0])
    scaler = getattr(wrapped, "scaler", None)
    if scaler is not None:
        scaler.group, scaler.across_ranks = None, True


def _pipeline_options(mp: dict) -> dict:
    return {k: mp[k] for k in ("microbatches", "schedule", "virtual_stages", "pp_split")}
