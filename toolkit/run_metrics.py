"""What a training run reports at its end: every step's loss averaged over the ranks (one collective after
training, none during it), and, when the run ended non-finite, the rank and step where the loss first went
non-finite (the gradient all-reduce spreads a NaN to every rank, so by the end nothing else says where)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .runtime.blame import Consequence
from .trace.events import recorder


def record_losses(losses, norms, world) -> None:
    """Per-step metrics, with the global mean loss computed once, after training.

    Averaging every step's loss over ranks needs a collective; issuing it during the step would add
    one to every step's trace. Instead each rank keeps its losses, and one raw all-reduce (not through
    `toolkit.comm`, so it is not recorded) averages them all at the end. Ranks hold equal numbers of
    rows, so the mean of the ranks' means is the loss of the whole global batch. The same all-reduce
    carries each rank's first step with a non-finite loss (in its own slot), for `where_it_went_non_finite`.
    """
    local = torch.stack(losses).float()
    steps = len(local)
    bad = (~torch.isfinite(local)).nonzero()
    slots = torch.zeros(world, device=local.device)
    slots[dist.get_rank() if world > 1 else 0] = float(bad[0, 0]) if len(bad) else float(steps)
    everyone = torch.cat([local, slots])
    if world > 1:
        dist.all_reduce(everyone)
        everyone[:steps] /= world
    for step, (mine, mean) in enumerate(zip(local.tolist(), everyone[:steps].tolist())):
        recorder.metric("loss", mean, step=step)
        recorder.metric("local_loss", mine, step=step)
    for step, norm in enumerate(torch.stack(norms).tolist() if norms else []):
        recorder.metric("grad_norm", norm, step=step)
    where_it_went_non_finite(local.tolist(), [int(f) for f in everyone[steps:].tolist()], everyone[steps - 1].item())


class NonFiniteLoss(FloatingPointError):
    """The run ended with a non-finite loss; raised on the rank(s) where it first appeared."""


class NonFiniteElsewhere(Consequence, NonFiniteLoss):
    """Raised on the other ranks: their loss went non-finite because the gradient all-reduce spread it."""


def where_it_went_non_finite(mine: list[float], first: list[int], final_mean: float) -> None:
    """A NaN or inf in one rank's loss reaches every rank's weights through the gradient all-reduce, so by the
    end every loss is NaN and nothing says where it started. If the run ended non-finite, name the rank(s)
    and the step where it first appeared. (A step that went non-finite and was skipped, as fp16's loss scale
    does, is no error: the run ended finite.)"""
    steps, rank = len(mine), dist.get_rank() if len(first) > 1 else 0
    if math.isfinite(final_mean) or min(first) >= steps:
        return
    earliest = min(first)
    causes = [r for r, f in enumerate(first) if f == earliest]
    story = (
        f"the loss went non-finite first on rank{'s' * (len(causes) > 1)} {', '.join(map(str, causes))} at "
        f"step {earliest} (of steps 0-{steps - 1}), and the run ended non-finite; "
    )
    if rank in causes:
        raise NonFiniteLoss(
            story + f"this rank's loss there was {mine[earliest]}. The gradient all-reduce then spread it to every "
            f"rank's weights. Look at what this rank computed at step {earliest}: its slice of that batch, a "
            f"learning rate too high, an overflow (fp16 without a loss scale), a log of 0 or a division by 0."
        )
    mine_too = (
        f"this rank's loss went non-finite at step {first[rank]} only because the gradient all-reduce spread it here"
        if first[rank] < steps
        else "this rank's own loss stayed finite"
    )
    raise NonFiniteElsewhere(story + mine_too + f": look at rank {causes[0]}'s error.")
