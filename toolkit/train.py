"""One training loop for every strategy; it produces a Run.

    run = train(TrainConfig(strategy="local", steps=30))                 # one process, the reference
    run = launch_train(TrainConfig(strategy="ddp", steps=30), world_size=2)  # N ranks, one merged Run

The loop is the plain PyTorch one, `loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()`,
so what differs between strategies is only what `toolkit.parallel.wrap` put inside the model and the
optimizer. Around it the loop labels phases (forward, backward, optimizer) so every collective in the
trace says when it happened, times each phase as a "compute" span, and samples memory at the phase
boundaries. Under pipeline parallelism (options pp > 1) a step's forward and backward are one call,
`loss = model.forward_backward(x, y)`: the schedule runs the micro-batches (options microbatches), each of
its actions a span labelled with its micro-batch and stage, memory sampled after each.

Data: step s uses the corpus's global batch s (`global_batch_size` rows); data-parallel replica r of N
takes its contiguous slice (every rank of a replica's tensor/pipeline/context-parallel group reads the
same rows), and with `accumulation` = M it splits that slice into M micro-batches, calling backward on
loss/M each. So the rows of a step are the same whatever N and M are, and every strategy, world size and
accumulation can be checked against "local" with accumulation 1.

`TrainConfig` (`train_config.py`) says what a run is; here, the loop that runs it and `launch_train`, which
starts the ranks and merges their Runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time

import torch
import torch.distributed as dist

from . import parallel
from .memory.ledger import ActivationMeter, record_memory
from .models import moe_gpt, tiny_gpt
from .models.protocol import recognise
from .run import Run
from .run_metrics import NonFiniteElsewhere, NonFiniteLoss, record_losses  # noqa: F401 - the errors: toolkit.train's
from .runtime import env
from .runtime.launch import launch
from .trace.events import phase, recorder, span
from .train_config import OPTIMIZERS, TrainConfig


def build_model(config: TrainConfig) -> torch.nn.Module:
    """The tiny GPT this config describes (seed first: weights depend on torch's RNG)."""
    return tiny_gpt(vocab_size=config.vocab_size, seq_len=config.seq_len, **config.model)


def moe_model_fn(num_experts: int = 4, top_k: int = 2, **moe_gpt_kwargs):
    """A ``model_fn`` for `train`: ``moe_gpt`` sized by the TrainConfig (vocab, seq_len, ``config.model``), experts
    seeded by ``config.seed`` unless ``seed=`` is given, and split over the ranks of a pipeline stage under
    ``options["pp"]``, or over ``options["ep"]`` of them (Megatron's carving: `toolkit.parallel.expert_layout`)
    (the layout is the training's, which is why this lives here and not in `toolkit.models`).

        train(TrainConfig(strategy="ddp"), model_fn=moe_model_fn(4, 2))
    """

    def build(config):
        kwargs = dict(seed=config.seed, vocab_size=config.vocab_size, seq_len=config.seq_len, **config.model)
        pp, ep = config.options.get("pp", 1), config.options.get("ep")
        if ep is not None:  # ep ranks carved from a stage's dp x cp x tp (toolkit/parallel/expert_layout.py)
            from .parallel.mesh import expert_group

            layout = {k: config.options[k] for k in ("tp", "pp", "cp", "order") if k in config.options}
            kwargs["group"] = expert_group(ep, **layout)
        elif pp > 1:  # a pipeline stage's experts are split over the ranks of that stage, not the world
            from .parallel.pipeline import stage_group

            kwargs["group"] = stage_group(
                pp=pp, **{k: config.options[k] for k in ("tp", "cp", "order") if k in config.options}
            )
        kwargs.update(moe_gpt_kwargs)
        return moe_gpt(num_experts, top_k, **kwargs)

    return build


def train(config, *, model_fn=None, loss_fn=None, batch_fn=None, return_state: bool = False):
    """Train on this rank (inside `launch`, or alone as world size 1); return this rank's Run.

    model_fn(config) -> nn.Module builds another model, for example a GPT with MoE layers or a Hugging Face
    model as it comes (`LlamaForCausalLM(config)`, a masked LM, an image classifier); by default `build_model`.
    How it is fed and called is recognised from it (`toolkit.models.protocol`); for anything else pass
    loss_fn(model, inputs, targets) -> scalar loss and/or batch_fn(step, global_batch_size, *, rank,
    world_size, device) -> (inputs, targets). With `return_state`, returns (run, full_state_dict) where the
    state is the final unsharded parameters on the CPU.

    The Run holds this call's work only (the trace recorder is reset first). Its metrics per step:
    "loss" (mean over all ranks and micro-batches: the loss of the whole global batch), "local_loss"
    (this rank's), "step_time" (seconds), "grad_norm" (when clipping), with fp16 "loss_scale" and
    "skipped_step" (1 when an overflow skipped the step); and once, "param_norm" (the L2 norm of the
    final full parameters, for comparing runs without the tensors).
    """
    config = TrainConfig.of(config)
    if loss_fn is not None and config.options.get("pp", 1) > 1:
        raise ValueError(
            "under pipeline parallelism (pp > 1) the last stage computes the loss with the model's own "
            "head_loss(h, y), so a loss_fn cannot be used: give the model embed, head_loss and "
            "hidden_shape (toolkit/models/hf_pipeline.py shows how), or train without pp."
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    config.check_world(world)
    if not dist.is_initialized() and config.strategy != "local":
        raise ValueError(
            f"strategy {config.strategy!r} needs ranks to talk to: run it with "
            f"launch_train(config, world_size=N), or call train inside toolkit.launch. "
            f"Only 'local' trains in a plain process."
        )
    device = env.device()
    recorder.reset()

    torch.manual_seed(config.seed)  # the same model on every rank; strategies also broadcast rank 0's
    model = (model_fn or build_model)(config).to(device)
    convention = recognise(model, loss_fn=loss_fn, batch_fn=batch_fn)  # before wrapping: the model as it came
    data = convention.data(model, vocab_size=config.vocab_size, seq_len=config.seq_len, seed=config.data_seed)
    make_optimizer = functools.partial(OPTIMIZERS[config.optimizer], lr=config.lr)
    with phase("setup"):
        model, opt = parallel.wrap(model, config.strategy, optimizer=make_optimizer, **config.options)

    meter = ActivationMeter(model)
    M = config.accumulation
    dp, dp_rank = config.data_parallel(world, rank)  # tp/pp ranks of one replica read the same rows

    def sample(step):
        if config.sample_memory:
            record_memory(model, opt, step=step, meter=meter)

    pipelined = hasattr(model, "pipeline")
    if pipelined and config.sample_memory:  # memory after every action of the schedule, activations rising and falling
        model.driver.observers.append(lambda action: sample(model.driver.calls - 1))
    losses, norms = [], []
    steps = _progress(range(config.steps), config, rank, world)
    for step in steps:
        t0 = time.perf_counter()
        x, y = data.batch(step, config.global_batch_size, rank=dp_rank, world_size=dp, device=device)
        step_loss = torch.zeros((), device=device)
        if pipelined:  # pp > 1: one call runs the schedule (every micro-batch; each action is a span of its own)
            sample(step)
            with meter:
                step_loss += model.forward_backward(x, y)
        for micro, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M)) if not pipelined else ()):
            # Gradients are synchronized once per step: skip it on all but the last micro-batch.
            quiet = config.no_sync and micro < M - 1 and hasattr(model, "no_sync")
            with model.no_sync() if quiet else contextlib.nullcontext():
                with phase("forward"):
                    sample(step)
                    with span("forward", step=step, micro=micro), meter:
                        loss = convention.loss(model, xm, ym)
                    sample(step)
                with phase("backward"):
                    with span("backward", step=step, micro=micro):
                        (loss if M == 1 else loss / M).backward()
                    sample(step)
            step_loss += loss.detach()
        with phase("optimizer"):
            with span("optimizer", step=step):
                if config.clip is not None:
                    norms.append(_clip(model, config.clip))
                opt.step()
                opt.zero_grad()
            sample(step)
        if getattr(model, "scaler", None) is not None:  # fp16: the loss scale this step ran with, and
            recorder.metric("loss_scale", model.scaler.last_scale, step=step)  # whether its update was
            recorder.metric("skipped_step", int(model.scaler.last_skipped), step=step)  # skipped (overflow)
        if device.type == "cuda":
            torch.cuda.synchronize()  # a step's time is the device's, not the host's
        recorder.metric("step_time", time.perf_counter() - t0, step=step)
        losses.append(step_loss / M)
        if hasattr(steps, "set_postfix") and rank == 0:
            steps.set_postfix(loss=f"{losses[-1].item():.3f}")

    record_losses(losses, norms, world)
    state = _final_state(model)
    recorder.metric("param_norm", math.sqrt(sum(float(v.double().pow(2).sum()) for v in state.values())))
    run = Run.capture(dataclasses.asdict(config))
    run.meta["model"] = {
        "class": type(model.module if hasattr(model, "module") else model).__name__,
        "convention": convention.name,
        "why": convention.why,
    }
    return (run, state) if return_state else run


def _progress(steps, config, rank, world):
    if not config.progress or rank != 0:
        return steps
    from tqdm.auto import tqdm

    return tqdm(steps, desc=f"{config.strategy} x{world}", leave=False)


def _clip(model, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm; a sharded strategy knows how to compute it across its shards."""
    if hasattr(model, "clip_grad_norm_"):
        norm = model.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return torch.as_tensor(norm).detach().float().reshape(())


def _final_state(model) -> dict:
    """The full parameters on the CPU. Gathering them may take collectives; they are bookkeeping, unrecorded."""
    enabled, recorder.enabled = recorder.enabled, False
    try:
        state = parallel.full_state_dict(model)
    finally:
        recorder.enabled = enabled
    return {name: t.detach().cpu() for name, t in state.items()}


def _rank_main(config, model_fn, return_state, loss_fn=None, batch_fn=None):
    run, state = train(config, model_fn=model_fn, loss_fn=loss_fn, batch_fn=batch_fn, return_state=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (run, state if rank == 0 else None) if return_state else run


def launch_train(
    config, world_size: int, *, model_fn=None, loss_fn=None, batch_fn=None, return_state: bool = False, **launch_kwargs
):
    """Start `world_size` ranks that each run `train(config)` (`model_fn`, `loss_fn`, `batch_fn` as there); return
    the merged Run.

    With `return_state`, returns (run, rank 0's final full parameters). `launch_kwargs` go to
    `toolkit.launch` (backend, timeout_s, quiet, ...).
    """
    config = TrainConfig.of(config)
    config.check_world(world_size)  # fail here, before starting processes
    results = launch(_rank_main, world_size, args=(config, model_fn, return_state, loss_fn, batch_fn), **launch_kwargs)
    if return_state:
        return Run.merge(r for r, _ in results), results[0][1]
    return Run.merge(results)
