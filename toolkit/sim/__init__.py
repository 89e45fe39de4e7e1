"""A simulated cluster: the strategies' own code for one rank of up to 65,536, and what a step would cost.

    sim = toolkit.sim.simulate(model_fn, "zero3", world_size=512, mixed_precision=True)

`simulate.py` runs it (a step watched by `watched_step.py`, on torch's fake process group, `fake.py`, and meta tensors,
`cluster.py`); `simulation.py` is what it returns; `program.py` is the record a simulated step leaves (compute, each
operation in it, and collectives in issue order), which the cost model reads, bottom up: `hardware.py` (what a user
names, resolved: the records in `hardware_records.py`, the presets with their sources in `hardware_presets.py`) and
`published.py` (a published measurement with its spread; the kernels' in `published_kernels.py`, the collectives' in
`published_collectives.py`), `kernel_time.py` (one operation's time: GEMM tiles in waves through the pipeline,
FlashAttention-2's rates, memory-bound kernels, launches), `collective_time.py` (nccl-tests' bus bandwidth by size and
the cards' rate on the presets, alpha-beta elsewhere), `timeline.py` (the overlap rule, compute slowed beside
collectives), `stage_timeline.py` (pipeline stages on one clock), `breakdown.py` (where a step's time goes), `cost.py`
(step time, breakdown, band, TFLOP/s, MFU, HFU, per-operation breakdown), `pipelined.py` (a pipeline's ranks priced
together) with `stage_assembly.py` (at scale: one rank per kind of stage), `modelled_run.py` (a priced step as a Run),
`calibrate.py` with `calibrate_compute.py` and `calibrate_links.py` ("this-machine"), `priced.py` (a Simulation priced
on the cluster a user names), `fused_adam.py` (the papers' one-kernel AdamW, for simulating their runs); `fit.py` says
whether the peak fits in the accelerator's memory and what would make it fit; `sweep.py` extrapolates a few layers to a
whole model over world sizes; `cli.py` is `python -m toolkit simulate`.
"""

from .cost import StepCost, compute_time, estimate, modelled_run  # noqa: F401
from .hardware import CLUSTERS, GPUS, Accelerator, Cluster, accelerator, cluster_of, presets  # noqa: F401
from .priced import price  # noqa: F401
from .program import Collective, Compute, Kernel, Wait  # noqa: F401
from .simulate import measure_steps, simulate  # noqa: F401
from .simulation import Simulation  # noqa: F401
