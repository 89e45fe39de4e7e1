"""How an average over N ranks is divided: part before the sum, the rest after (torch FSDP's factors).

Data parallelism averages gradients: (g_1 + ... + g_N) / N. Summing first and dividing after is
exact in fp32 and bf16 (their range is 3e38), but not in fp16, whose largest number is 65504: two
ranks' finite, loss-scaled gradients of 39,321 each sum to 78,642 = inf, the loss scaler sees an
overflow and skips a step whose average (39,321) was perfectly representable, and the larger N the
more such steps are thrown away. Dividing everything first has the opposite risk: tiny gradients
divided by a large N fall below fp16's smallest subnormal (6e-8) and vanish.

torch's FSDP (FSDP1 ``DefaultState._get_gradient_predivide_factor``, FSDP2
``_get_gradient_divide_factors``) splits the division for fp16: divide by ``pre`` before the sum and by
``post = N / pre`` after it, with ``pre`` the power of two near sqrt(N) (doubled while it divides N and
stays below N / pre). fp32 and bf16 have no overflow risk and divide once, after the sum (NCCL's
ReduceOp.AVG). torch DDP divides by N while copying each gradient into its bucket (``pre = N``, for
every dtype): ``parallel/ddp.py`` does that itself.

    N      2    4    8    16   64
    pre    2    2    4    4    8
    post   1    2    2    4    8
"""

from __future__ import annotations

import torch

OVERFLOW_RISK = (torch.float16,)  # bf16 and fp32 share fp32's exponent range


def predivide_factor(world: int) -> int:
    """torch FSDP's ``pre`` for N = world: 1, doubled while it divides N and N / pre > pre."""
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return pre


def divide_factors(world: int, dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post): divide by ``pre`` before summing N ranks' values and by ``post`` after, pre · post = N.
    fp16 splits the division (see the module doc); every other dtype divides once, after: (1, N)."""
    if world < 1:
        raise ValueError(f"an average needs at least one rank, got world={world}.")
    if dtype not in OVERFLOW_RISK:
        return 1.0, float(world)
    pre = float(predivide_factor(world))
    return pre, world / pre


def divide_around_sum(world: int, before: torch.Tensor, after: torch.Tensor):
    """The door's op="avg": divide ``before`` (what is about to be summed) by ``pre`` in place now, and return
    what divides ``after`` (where the sum lands) by ``post`` once it is there, or None when post is 1."""
    pre, post = divide_factors(world, before.dtype)
    if pre != 1:
        before.div_(pre)
    return (lambda: after.div_(post)) if post != 1 else None
