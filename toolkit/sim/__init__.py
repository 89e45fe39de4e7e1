"""A simulated cluster: the strategies' own code for one rank of up to 1024, and what a step would cost.

    sim = toolkit.sim.simulate(model_fn, "zero3", world_size=512, mixed_precision=True)

`simulate.py` runs it (on torch's fake process group, `fake.py`, and meta tensors, `cluster.py`);
`simulation.py` is what it returns; `program.py` is the record a simulated step leaves (compute and
collectives in issue order), which the cost model reads: `hardware.py` (presets with their sources),
`collective_time.py` (alpha-beta on a two-level cluster), `timeline.py` (the overlap rule),
`cost.py` (step time, breakdown, TFLOP/s, MFU and a modelled Run), `calibrate.py` ("this-machine").
"""
from .cost import StepCost, compute_time, estimate, modelled_run, price  # noqa: F401
from .hardware import CLUSTERS, GPUS, Accelerator, Cluster, accelerator, cluster_of, presets  # noqa: F401
from .program import Collective, Compute, Kernel, Wait  # noqa: F401
from .simulate import measure_steps, simulate  # noqa: F401
from .simulation import Simulation  # noqa: F401
