"""`simulate`: one rank of a large cluster, running the strategies' own code, in this process.

    sim = toolkit.sim.simulate(presets.gpt3_175b, "zero3", world_size=512, mixed_precision=True)
    sim.memory, sim.peak, sim.bytes_per_step, sim.flops, sim.programs, sim.run

What happens, in order:

1. a fake process group of `world_size` ranks makes this process rank `rank` (`cluster.py`);
2. `model_fn()` builds the model on the meta device: shapes and dtypes, no memory, no values;
3. `toolkit.parallel.wrap(model, strategy, **options)` wraps it exactly as on a real rank: the flat
   buffers, shards, buckets and gathered copies it makes are meta tensors of their real sizes;
4. whole training steps run (forward, backward, optimizer step) in the same phases and spans as
   `toolkit.train`, while two counters watch every operation: MemTracker (memory by category,
   `memory.py`) and an op counter (FLOPs, bytes and kernels, `record.py`); the collectives door reports every
   call and every wait, which cuts the step into a program (`program.py`);
5. the group is destroyed; what was recorded becomes a `Simulation` (`simulation.py`).

`measure_steps` (4, `watched_step.py`) is the same on a real process group with real tensors: that is how the tests
hold the simulation to a real gloo run of the same code.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .. import parallel
from ..moe.experts import is_expert
from ..moe.gates import assume_routing
from ..moe.layer import MoE
from ..parallel.zero import ZERO1_REDUCES_ONCE
from ..run import Run
from ..trace.events import phase
from . import cluster as _cluster
from .build import build, build_on_meta, count_params, example_batch, no_values, seq_len_of  # noqa: F401 - build_on_meta: the tests'
from .context_parallel import describe as describe_cp
from .hardware import check_mfu
from .pipelined import is_pipelined
from .priced import pricer, resolve
from .simulation import Simulation
from .stage_assembly import simulate_pipeline
from .tensor_parallel import describe as describe_tp
from .unpacked_rows import unpacked_rows
from .watched_step import measure_steps, train_step  # noqa: F401 (measure_steps, train_step: the tests')


def simulate(
    model_fn,
    strategy: str,
    world_size: int,
    *,
    rank: int = 0,
    ranks_per_node: int | None = None,
    batch_per_rank: int = 1,
    accumulation: int = 1,
    no_sync: bool = True,
    seq_len: int | None = None,
    steps: int = 1,
    warmup: bool = True,
    optimizer=torch.optim.AdamW,
    routing=None,
    progress: bool = True,
    cluster=None,
    mfu: float | None = None,
    every_stage: bool = False,
    loss_fn=None,
    batch_fn=None,
    **options,
) -> Simulation:
    """Run `steps` training steps of `strategy` for rank `rank` of a simulated `world_size`-rank cluster.

    model_fn() builds the model (called under `torch.device("meta")`, `build.py`): the toolkit GPT, or any model,
    a Hugging Face one as it comes; it is fed and called as `toolkit.train` would (`toolkit.models.protocol`,
    or `loss_fn` / `batch_fn` as there), a batch of `batch_per_rank` examples of seq_len tokens. seq_len
    defaults to the model's (its `config.seq_len`, max_position_embeddings, or an image's patches). options go
    to `toolkit.parallel.wrap` (mixed_precision, sharding_group_size, ...).
    accumulation: a step's `batch_per_rank` sequences as that many micro-batches, each a forward and a backward,
    then one optimizer step, as `toolkit.train` runs them: all but the last inside the strategy's `no_sync()`, so
    DDP, ZeRO-1 and FSDP reduce the gradients once a step (ZeRO-2 and ZeRO-3 keep only a slice and reduce every
    micro-batch's); no_sync=False reduces every micro-batch's whatever the strategy (Composer's FSDP does).
    warmup: first run one step unwatched, so that what is measured is a steady step (an optimizer such as
    Adam creates its states during its first step; ZeRO-3 and FSDP learn the module order in their first
    forward). The Run holds the warm-up step too; programs and memory are of the `steps` after it.
    routing: how MoE gates choose experts, `fn(T, E, k) -> (T, k)` expert ids (meta tokens have no values
    to score); default `balanced`, every expert gets the same number of tokens. Every rank routes alike, so rank
    `rank`'s experts compute what all ranks send them (`fake.alike_all_to_all`); under a skewed routing the ranks'
    loads differ, and the busiest is not always rank 0 (capacity caps the hottest expert): simulate each rank.
    Tensor parallelism: `tp=`, `sequence_parallel=`, `tp_plan=` as in `toolkit.parallel.wrap`; the world is then
    dp x tp and `batch_per_rank` is the sequences of one data-parallel replica (every rank of its tp group
    computes on them). A tp group wider than `ranks_per_node` is allowed, with a warning that says its cost.
    Context parallelism: `cp=`, `cp_attention=` ("ring", "ring-unbalanced", "ulysses"); each rank of a cp group
    computes on its seq_len/cp tokens of the replica's sequences (`sim.context_parallel`). `order=` lays the ranks
    out (Megatron's "tp-cp-ep-dp-pp" by default), which decides which groups cross nodes.
    Pipeline parallelism: `pp=`, `microbatches=`, `schedule=`, `virtual_stages=`, `pp_split=`; `batch_per_rank` is
    still a replica's sequences (split into the micro-batches), and a step is the schedule (`forward_backward`).
    Priced on a cluster, the step is the critical path of this rank's whole pipeline (`toolkit.sim.pipelined`):
    one rank of each kind of stage is simulated with the fewest micro-batches that reach its peak, and every
    rank's program for the real micro-batches is put together from theirs (`every_stage=True`: every rank, every
    micro-batch, the same result slower); `sim.stage_sims` are the pipeline's ranks, `sim.stage_peaks` the peaks
    of those simulated.
    cluster: price the steps on a cluster (`toolkit.sim.presets()`: "dgx-a100", "dgx-h100", "this-machine",
    or a user-defined one) and fill sim.fit (the peak against its accelerator's memory: sim.fits), cost and
    modelled_run, and, when it fits, sim.step_time, tflops_per_gpu, mfu and breakdown (`cost.pricer`);
    mfu overrides the preset's achievable fraction of peak (pricing only: it needs a cluster).
    ranks_per_node: the cluster's GPUs per node by default (8 without a cluster); another number prices the
    cluster with nodes of that size, a what-if that a warning says.
    """
    found = None if cluster is None else resolve(cluster, world_size)  # a bad cluster fails before the work
    nodes = _cluster.check(world_size, rank, _node_size(ranks_per_node, found))
    if found is None and mfu is not None:
        check_mfu(mfu)
        raise ValueError(
            f"mfu={mfu} is the fraction of peak a cluster's GPUs reach when the step is priced, and no "
            f"cluster was given: pass cluster= with it (e.g. cluster='dgx-a100'), or leave mfu out."
        )
    if is_pipelined(options) and accumulation != 1:
        raise ValueError(
            f"under pp={options['pp']} the pipeline's schedule splits each replica's batch into micro-batches "
            f"(microbatches=pp by default): leave accumulation=1 (got {accumulation})."
        )
    price = None if found is None else pricer(found, world_size, mfu=mfu)
    if price is not None and is_pipelined(options):  # the step is the pipeline's: its other stages are needed
        again = functools.partial(
            simulate,
            model_fn,
            strategy,
            world_size,
            ranks_per_node=ranks_per_node,
            seq_len=seq_len,
            warmup=warmup,
            optimizer=optimizer,
            routing=routing,
            progress=progress,
            loss_fn=loss_fn,
            batch_fn=batch_fn,
        )
        return simulate_pipeline(
            again,
            price,
            world_size=world_size,
            rank=rank,
            batch_per_rank=batch_per_rank,
            steps=steps,
            every_stage=every_stage,
            options=options,
        )
    if strategy not in parallel.STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(parallel.STRATEGIES)}.")
    for name, value in (("batch_per_rank", batch_per_rank), ("steps", steps), ("accumulation", accumulation)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    _check_accumulation(strategy, batch_per_rank, accumulation, no_sync)
    if isinstance(model_fn, torch.nn.Module):
        raise ValueError(
            f"model_fn must be the function that builds the model, not a model already built (got a "
            f"{type(model_fn).__name__}): the simulator builds it itself, on the meta device. Pass e.g. "
            f"`lambda: tiny_gpt(n_layer=2)` or `functools.partial(presets.gpt3_175b, n_layer=2)`."
        )
    if not callable(model_fn):
        raise ValueError(f"model_fn must be a function that builds the model, got {model_fn!r}.")
    with _cluster.cluster(world_size, rank), assume_routing(routing or balanced):
        model, convention = build(model_fn, loss_fn=loss_fn, batch_fn=batch_fn)
        num_params, expert_params = count_params(model)
        expert_parallel = max([m.world for m in model.modules() if isinstance(m, MoE)], default=1)
        row_flops = {
            m.name: getattr(m, "row_flops", 4 * m.d_model * m.d_ff)  # two GEMMs (a SwiGLU's: three)
            for m in model.modules()
            if isinstance(m, MoE)
        }
        local_experts = sum(p.numel() for p in model.parameters() if is_expert(p))
        seq = seq_len_of(model, convention, seq_len)
        x, y = example_batch(model, convention, batch_per_rank, seq)  # the model as built, before it is wrapped
        if strategy == "fsdp" and "param_init_fn" not in options:
            options["param_init_fn"] = no_values  # FSDP's deferred initialization, with nothing to fill
        with phase("setup"):
            model, opt = parallel.wrap(model, strategy, optimizer=optimizer, **options)
        tensor_parallel = describe_tp(model, options, batch_per_rank, seq, world_size, nodes)
        context_parallel = describe_cp(model, options, batch_per_rank, seq, world_size, accumulation)
        bar = _progress(progress, strategy, world_size, (steps + warmup) * (2 * accumulation + 1))
        try:
            loop = dict(loss_fn=convention.loss, accumulation=accumulation, no_sync=no_sync)
            with unpacked_rows():  # a transformers model's causal mask, on meta tensors (its module is imported now)
                if warmup:  # the optimizer makes its states in its first step (Adam does): measure a steady one
                    train_step(model, opt, x, y, step=0, bar=bar, **loop)
                measured = measure_steps(model, opt, x, y, steps, bar=bar, meta=True, first=int(warmup), **loop)
        finally:
            if bar is not None:
                bar.close()
        run = Run.capture(
            dict(
                strategy=strategy,
                options={k: repr(v) for k, v in options.items()},
                batch_per_rank=batch_per_rank,
                accumulation=accumulation,
                no_sync=no_sync,
                seq_len=seq,
                steps=steps,
            ),
            align=False,
        )
    run.meta.update(simulated=True, ranks_per_node=nodes)
    sim = Simulation(
        strategy=strategy,
        world_size=world_size,
        rank=rank,
        ranks_per_node=nodes,
        options=dict(options),
        num_params=num_params,
        expert_params=expert_params,
        expert_parallel=expert_parallel,
        local_expert_params=local_experts,
        batch_per_rank=batch_per_rank,
        accumulation=accumulation,
        no_sync=no_sync,
        seq_len=seq,
        run=run,
        expert_row_flops=row_flops,
        **measured,
    )
    sim.tensor_parallel = tensor_parallel  # None unless tp= (sim/tensor_parallel.py)
    sim.context_parallel = context_parallel  # None unless cp= (sim/context_parallel.py)
    sim.pipeline_info = getattr(model, "pipeline", None)  # pp > 1: the schedule, its actions, the blocks' split
    if price is not None:
        price(sim)
    return sim


def _node_size(ranks_per_node, found) -> int:
    """GPUs per node: the cluster's unless asked otherwise (then said: the preset's nodes change), else 8."""
    if ranks_per_node is None:
        return 8 if found is None else found.gpus_per_node
    if found is not None and ranks_per_node != found.gpus_per_node and not isinstance(ranks_per_node, bool):
        warnings.warn(
            f"ranks_per_node={ranks_per_node}: {found.name!r} has nodes of {found.gpus_per_node} GPUs; "
            f"priced as {found.name!r} with nodes of {ranks_per_node} (its links inside a node among "
            f"{ranks_per_node} GPUs, its network between them). Leave ranks_per_node out to keep the "
            f"cluster's nodes, or say it with a cluster of such nodes: "
            f"cluster=toolkit.sim.cluster_of(cluster, gpus_per_node={ranks_per_node}).",
            stacklevel=3,
        )
    return ranks_per_node


def _check_accumulation(strategy: str, batch_per_rank: int, accumulation: int, no_sync) -> None:
    """A step's sequences must split into whole micro-batches; no_sync is a yes or a no, and a yes for ZeRO-1."""
    if not isinstance(no_sync, bool):
        raise ValueError(f"no_sync must be True or False, got {no_sync!r}.")
    if strategy == "zero1" and accumulation > 1 and not no_sync:
        raise ValueError(f"{ZERO1_REDUCES_ONCE}: drop no_sync=False, or use strategy='zero2'.")
    if batch_per_rank % accumulation:
        whole = [m for m in range(1, batch_per_rank + 1) if batch_per_rank % m == 0]
        raise ValueError(
            f"batch_per_rank={batch_per_rank} does not split into accumulation={accumulation} equal micro-batches: "
            f"use an accumulation that divides it ({', '.join(map(str, whole))}), or "
            f"batch_per_rank={accumulation * max(1, batch_per_rank // accumulation)}."
        )


def balanced(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """An MoE routing in which every expert gets the same share: choice j of token t is expert (t*k + j) mod E."""
    index = torch.arange(num_tokens * top_k, device="cpu").reshape(num_tokens, top_k)
    return index % num_experts


def _progress(progress: bool, strategy: str, world_size: int, phases: int):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=phases, desc=f"simulating {strategy} x{world_size}", unit="phase", leave=False)
