"""`load_state_dict()` into a wrapped model: each value goes where the strategy trains it.

torch's load copies each value into the module's parameter. A strategy may train something else:
- under mixed precision the optimizer steps fp32 masters and rounds them into the 16-bit parameters, so a value
  copied into the parameter alone is rounded, then overwritten by the old master at the next step;
- ZeRO keeps those masters as this rank's slice of each flat buffer;
- between uses ZeRO-3's and FSDP's parameters are this rank's pieces, which a full value does not fit.

So a pre-hook on every module asks the strategy, parameter by parameter (`where(p)`), where its value trains: None
(the parameter itself: torch's copy is enough), or a `Place`: a function that writes the fp32 value there, and whether
torch's own copy into the parameter follows (it does not where the parameter is a piece: the key is taken out of the
load, and a post-hook takes it out of the missing keys). `assign=True` is refused: it would swap the Parameter objects
that the strategy's buffers and optimizer hold.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Place:
    write: Callable[[torch.Tensor], None]  # the fp32 value, written where it trains
    torch_copies: bool = True  # then torch copies it into the parameter (rounded to its dtype)
    shape: tuple | None = None  # the parameter's full shape, where `p.shape` is only this rank's piece


def watch_loading(module: torch.nn.Module, strategy: str, where) -> None:
    for m in module.modules():
        taken: list[str] = []  # keys this module's parameters took out of torch's load
        m.register_load_state_dict_pre_hook(functools.partial(_before_loading, strategy, where, taken))
        m.register_load_state_dict_post_hook(functools.partial(_after_loading, taken))


def _before_loading(strategy, where, taken, module, state_dict, prefix, local_metadata, *_) -> None:
    own = [(prefix + n, p) for n, p in module._parameters.items() if p is not None]
    if own and local_metadata.get("assign_to_params_buffers", False):
        refuse(strategy, own[0][0], "assign=True would replace the Parameter objects its buffers and optimizer hold")
    taken.clear()
    with torch.no_grad():
        for key, p in own:
            place, value = where(p), state_dict.get(key)
            if place is None or not torch.is_tensor(value):
                continue
            shape = tuple(place.shape or p.shape)
            if tuple(value.shape) != shape:
                if place.torch_copies:
                    continue  # torch's own copy says "size mismatch"
                raise RuntimeError(
                    f"load_state_dict(): size mismatch for {key!r}: a value of shape "
                    f"{tuple(value.shape)} for a parameter of shape {shape}."
                )
            place.write(value.detach().to(torch.float32))
            if not place.torch_copies:
                del state_dict[key]
                taken.append(key)


def _after_loading(taken, module, incompatible_keys) -> None:
    for key in taken:
        if key in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(key)
    taken.clear()


def refuse(strategy: str, key: str, why: str) -> None:
    raise RuntimeError(
        f"load_state_dict() into {key!r} under {strategy}: {why}, so the loaded values would not be the ones trained. "
        f"Load the weights into the model before wrap(model, ...), or load a full checkpoint into the wrapped model: "
        f"toolkit.parallel.checkpoint.load_full(model, optimizer, path)."
    )


def into_slices(slices, flat, index: int, rank: int, torch_copies: bool) -> Place:
    """A `Place` that writes parameter `index`'s value into each of `slices`: tensors laid out as this rank's slice of
    the flat buffer `flat` (the fp32 master; ZeRO-3's 16-bit kept slice beside it)."""

    def write(value: torch.Tensor) -> None:
        for part in flat.pieces(rank):
            if part.index == index:
                whole = value.reshape(-1)[part.tensor_start : part.tensor_end]
                for target in slices:
                    target.data[part.shard_start : part.shard_end].copy_(whole)

    return Place(write, torch_copies, tuple(flat.shapes[index]))
