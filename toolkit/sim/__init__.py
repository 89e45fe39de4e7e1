"""A simulated cluster: the strategies' own code for one rank of up to 1024, and what a step would cost.

`program.py` is the record a simulated step leaves (compute and collectives in issue order); the
simulator fills it, the cost model reads it.
"""
from .program import Collective, Compute, Wait  # noqa: F401
