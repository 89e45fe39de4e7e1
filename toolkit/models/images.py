"""Synthetic labelled images made in code, for image classifiers (a Hugging Face ViT, a ConvNet): no downloads.

Class c has a fixed random picture, its prototype; an example of class c is that prototype plus noise. A
classifier learns the prototypes in a few steps, so its loss falls visibly from log(num_classes).

As with the token corpus (`corpus.py`), a batch is a pure function of (seed, step, global batch size), and rank
r of N takes the r-th contiguous slice of the global batch, so N ranks together see what one process sees.
"""

from __future__ import annotations

import math

import torch

from .corpus import _check_positive_int, _check_rank, _generator


class SyntheticImages:
    """``batch(step, global_batch_size)`` -> ``(pixels (B, channels, size, size) float32, labels (B,) int64)``."""

    def __init__(self, num_classes: int, image_size: int, channels: int = 3, seed: int = 0, noise: float = 0.5):
        for name, value in (("num_classes", num_classes), ("image_size", image_size), ("channels", channels)):
            _check_positive_int(name, value)
        self.num_classes, self.image_size, self.channels, self.seed, self.noise = (
            num_classes,
            image_size,
            channels,
            seed,
            float(noise),
        )
        shape = (num_classes, channels, image_size, image_size)
        self.prototypes = torch.randn(shape, generator=_generator("prototypes", seed))

    def batch(
        self,
        step: int,
        global_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step`` (rows [rank*b, (rank+1)*b) of it with ``world_size`` > 1, b = B / world_size)."""
        _check_positive_int("global_batch_size", global_batch_size)
        _check_rank(rank, world_size, global_batch_size)
        g = _generator("images", self.seed, step, global_batch_size)
        labels = torch.randint(self.num_classes, (global_batch_size,), generator=g)
        pixels = self.prototypes[labels] + self.noise * torch.randn(
            (global_batch_size,) + tuple(self.prototypes.shape[1:]), generator=g
        )
        b = global_batch_size // world_size
        pixels, labels = pixels[rank * b : (rank + 1) * b], labels[rank * b : (rank + 1) * b]
        if device is not None:
            pixels, labels = pixels.to(device), labels.to(device)
        return pixels, labels

    def uniform_loss(self) -> float:
        """The loss of a classifier that knows nothing: log(num_classes)."""
        return math.log(self.num_classes)

    def __repr__(self) -> str:
        return (
            f"SyntheticImages(num_classes={self.num_classes}, image_size={self.image_size}, "
            f"channels={self.channels}, seed={self.seed})"
        )
