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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import parallel
from .memory.ledger import ActivationMeter, record_memory
from .models import GPTConfig, moe_gpt, tiny_gpt
from .models.protocol import recognise
from .run import Run
from .run_metrics import NonFiniteElsewhere, NonFiniteLoss, record_losses  # noqa: F401 - the errors: toolkit.train's
from .runtime import env
from .runtime.launch import launch
from .trace.events import phase, recorder, span

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


@dataclass
class TrainConfig:
    """Everything that defines a training run; saved in the Run so a figure can say what it shows.

    strategy: a name from `toolkit.parallel.STRATEGIES`; options: that strategy's own (bucket size,
    mixed precision, ...). model: overrides for `tiny_gpt` (n_layer, d_model, ...). vocab_size,
    seq_len, data_seed: the synthetic corpus (the model gets the same vocab_size and seq_len).
    global_batch_size: rows per optimizer step over all ranks; accumulation: micro-batches per step.
    clip: max gradient norm, or None for no clipping. sample_memory: record the memory ledger at
    phase boundaries. progress: a progress bar on rank 0.
    """

    strategy: str = "local"
    steps: int = 20
    global_batch_size: int = 8
    accumulation: int = 1
    model: dict = field(default_factory=dict)
    vocab_size: int = 64
    seq_len: int = 32
    data_seed: int = 0
    optimizer: str = "adamw"
    lr: float = 3e-3
    seed: int = 0
    clip: float | None = None
    options: dict = field(default_factory=dict)
    progress: bool = True
    sample_memory: bool = True

    def __post_init__(self):
        if self.strategy not in parallel.STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {sorted(parallel.STRATEGIES)}.")
        for name in ("steps", "global_batch_size", "accumulation", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {value!r}.")
        if self.global_batch_size % self.accumulation:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split into "
                f"accumulation={self.accumulation} equal micro-batches; use a multiple of it."
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {sorted(OPTIMIZERS)}.")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}.")
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise ValueError(f"TrainConfig.clip must be a positive max norm or None, got {self.clip!r}.")
        if not isinstance(self.model, dict) or not isinstance(self.options, dict):
            raise ValueError("TrainConfig.model and TrainConfig.options must be dicts.")
        fields = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "seq_len"}
        unknown = set(self.model) - fields
        if unknown:
            hint = (
                " (set TrainConfig.vocab_size / seq_len instead: the corpus and the model share them)"
                if unknown & {"vocab_size", "seq_len"}
                else ""
            )
            raise ValueError(
                f"TrainConfig.model has unknown key(s) {sorted(unknown)}{hint}; valid keys: {sorted(fields)}."
            )

    def check_world(self, world_size: int) -> None:
        """Each data-parallel replica's micro-batch must be whole rows: global_batch_size % (dp * accumulation)
        == 0, where dp = world_size / (tp x pp x cp) (the ranks of one tensor/pipeline/context-parallel group share
        rows); under pp the schedule's `microbatches` (default pp) take the place of accumulation. Under cp the
        sequence must split into the cp ranks' chunks."""
        dp, _ = self.data_parallel(world_size)
        if self.options.get("cp", 1) > 1:
            from .parallel.context import SequenceSplit

            attention = self.options.get("cp_attention", "ring")
            SequenceSplit(self.options["cp"], 0, zigzag=attention == "ring").check(self.seq_len, "TrainConfig.seq_len")
        pp = self.options.get("pp", 1)
        if pp > 1 and self.accumulation != 1:
            raise ValueError(
                f"under pp={pp} the pipeline's schedule splits each replica's batch into micro-batches "
                f"(options['microbatches']): leave accumulation at 1 (got {self.accumulation})."
            )
        per = dp * (self.options.get("microbatches") or pp if pp > 1 else self.accumulation)
        if self.global_batch_size % per:
            ranks = f"world_size={world_size}" if dp == world_size else f"dp={dp} replicas (world {world_size})"
            split = f"microbatches={per // dp}" if pp > 1 else f"accumulation={self.accumulation}"
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not divide over {ranks} x "
                f"{split} = {per} micro-batches; use a "
                f"multiple of {per}, e.g. {per * max(1, self.global_batch_size // per)}."
            )

    def data_parallel(self, world_size: int, rank: int = 0) -> tuple[int, int]:
        """(dp, this rank's dp index): the world is dp x pp x cp x tp (`options` tp=, pp=, cp=, order=), and a rank
        reads the rows of its data-parallel replica, the same rows as every rank of its tp, pp and cp groups (a cp
        rank keeps its own tokens of them)."""
        from .parallel import mesh

        o = self.options
        layout = mesh.layout(
            world_size, tp=o.get("tp", 1), pp=o.get("pp", 1), cp=o.get("cp", 1), order=o.get("order", mesh.ORDER)
        )
        return layout.dp, layout.coordinate(rank).dp

    @classmethod
    def of(cls, config) -> TrainConfig:
        """A TrainConfig from a TrainConfig or a dict (a Run's `config`)."""
        return config if isinstance(config, cls) else cls(**dict(config))


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
            quiet = micro < M - 1 and hasattr(model, "no_sync")
            with model.no_sync() if quiet else contextlib.nullcontext():
                with phase("forward"):
                    sample(step)
                    with span("forward", step=step, micro=micro), meter:
                        loss = convention.loss(model, xm, ym)
                    sample(step)
                with phase("backward"):
                    with span("backward", step=step, micro=micro):
                        (loss / M).backward()
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
