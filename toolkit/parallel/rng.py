"""Random numbers under model parallelism: dropout masks that agree where the ranks hold the same tensor and
differ where each holds its own piece (Megatron-LM's `CudaRNGStatesTracker` and `model_parallel_cuda_manual_seed`,
for any device).

Inside a tensor-parallel group some activations are the same on every rank (after g: the residual stream, the
embeddings) and some are split (this rank's attention heads; under sequence parallelism this rank's positions).
Dropout on a replicated activation must draw the same mask on every rank, or the replicas stop being copies;
dropout on a split one must draw a mask of its own on each rank, or rank 1's heads repeat rank 0's pattern.
So there are two streams of random numbers:

    default            the process's own generator, seeded alike on every rank (`torch.manual_seed(seed)` before
                       the model is built, as `toolkit.train` does): replicated regions draw from it, the same
                       masks on every tp rank, and the same as one process with that seed draws
    "tensor-parallel"  seed + 2718 + tp rank (Megatron's offset): split regions `fork()` into it, one mask per
                       piece; the same on every dp replica, whose data differ anyway

`fork()` swaps the device's generator state for the stream's and back, so a draw inside it leaves the default
stream where it was. A pipeline offsets both by 100 · its stage (Megatron's `_set_random_seed`), so stages do
not repeat each other's masks (`pipeline/__init__.py` calls `offset_stage`). Activation checkpointing replays
the streams' states when it recomputes (`checkpoint_contexts`), as torch's checkpoint replays the default one.

The seed is `torch.initial_seed()`: the last `torch.manual_seed`. Seed every rank alike before wrapping, as
Megatron asks (an unseeded process gets a random seed of its own, and its replicated dropout disagrees).
(Megatron keeps it in tensor_parallel/random.py; here it serves activation checkpointing and pipelines too, so
it lives beside them, and tensor parallelism seeds its stream when it splits a model.)
"""

from __future__ import annotations

import contextlib

import torch

TENSOR_PARALLEL = "tensor-parallel"
OFFSET, STAGE = 2718, 100  # Megatron's: the tensor-parallel stream's seed offset, a pipeline stage's


def _module(device: torch.device):
    return torch if device.type == "cpu" else torch.get_device_module(device.type)


def _get(device: torch.device) -> torch.Tensor:
    return _module(device).get_rng_state()


def _set(device: torch.device, state: torch.Tensor) -> None:
    _module(device).set_rng_state(state)


def _seeded(device: torch.device, seed: int) -> torch.Tensor:
    """The generator state `seed` gives on `device`, without moving the device's own stream."""
    saved = _get(device)
    (torch.default_generator if device.type == "cpu" else _module(device)).manual_seed(seed)
    state = _get(device)
    _set(device, saved)
    return state


class RNGStatesTracker:
    """Named generator states beside the default one; `fork(name)` draws from one of them."""

    def __init__(self):
        self.states: dict[str, tuple[torch.device, torch.Tensor]] = {}

    def add(self, name: str, seed: int, device) -> None:
        device = torch.device(device)
        if device.type == "meta":  # the simulated cluster draws no random numbers: nothing to keep
            self.states.pop(name, None)
            return
        self.states[name] = (device, _seeded(device, seed))

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL):
        """Inside, the device's generator is the stream `name`'s (as it was left last time); outside, the default
        stream continues as if nothing had been drawn. Without the stream (no tensor parallelism, or on the
        simulated cluster) it is the default stream, as in one process."""
        if name not in self.states:
            yield
            return
        device, state = self.states[name]
        default = _get(device)
        _set(device, state)
        try:
            yield
        finally:
            self.states[name] = (device, _get(device))
            _set(device, default)

    def get_states(self) -> dict:
        return {name: (device, state.clone()) for name, (device, state) in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = {name: (device, state.clone()) for name, (device, state) in states.items()}


tracker = RNGStatesTracker()  # one per process, as Megatron's


def seed_tensor_parallel(tp_rank: int, pp_rank: int, device) -> None:
    """The tensor-parallel stream of this rank: seed + 100 · stage + 2718 + tp rank (`seed` = torch.initial_seed())."""
    tracker.add(TENSOR_PARALLEL, torch.initial_seed() + STAGE * pp_rank + OFFSET + tp_rank, device)


def offset_stage(pp_rank: int, device) -> None:
    """Pipeline stage `pp_rank`'s default stream: seed + 100 · stage (the first stage's left as it is, so a pipeline
    of one stage draws what one process draws)."""
    device = torch.device(device)
    if pp_rank and device.type != "meta":
        _set(device, _seeded(device, torch.initial_seed() + STAGE * pp_rank))


def checkpoint_contexts():
    """torch.utils.checkpoint's `context_fn`: the recomputation draws from the streams' states as they were when
    the forward ran (torch restores the default stream's itself), and the streams continue afterwards as before."""
    at_forward = tracker.get_states()

    @contextlib.contextmanager
    def recompute():
        now = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            yield
        finally:
            tracker.set_states(now)

    return contextlib.nullcontext(), recompute()


def split_region_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout of a split activation (this rank's piece): its mask drawn from the tensor-parallel stream."""
    if not training or p == 0:
        return x
    with tracker.fork():
        return torch.nn.functional.dropout(x, p, True)


class SplitDropout(torch.nn.Dropout):
    """An nn.Dropout on a split activation (sequence parallelism's positions): masks from the tensor-parallel stream
    (the class of a GPT's dropout is swapped in place, as `sequence.sum_gradients_over_tp` swaps a LayerNorm's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_region_dropout(x, self.p, self.training)
