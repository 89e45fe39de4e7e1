"""`load_state_dict()` into a wrapped model: the weights go where the strategy trains them, or the load is refused.

torch's load copies each value into the module's parameter. A strategy may train something else:
- under mixed precision the optimizer steps fp32 masters and rounds them into the 16-bit parameters, so a value
  copied into the parameter alone is rounded, then overwritten by the old master at the next step;
- ZeRO-1/2 in mixed precision keep those masters as this rank's slice of each flat buffer;
- between uses ZeRO-3's and FSDP's parameters are this rank's pieces, which a full value does not fit.

So a pre-hook on every module asks the strategy, parameter by parameter (`where(p)`), where its value trains:
None (the parameter itself: torch's copy is enough), a function that writes the fp32 value there (then torch rounds it
into the parameter, as `checkpoint.load_full` leaves it), or the reason it cannot be loaded here, which is raised
before anything is written. `assign=True` is refused everywhere: it would swap the Parameter objects that the
strategy's buffers and optimizer hold.
"""

from __future__ import annotations

import functools

import torch


def watch_loading(module: torch.nn.Module, strategy: str, where) -> None:
    for m in module.modules():
        m.register_load_state_dict_pre_hook(functools.partial(_before_loading, strategy, where))


def _before_loading(strategy, where, module, state_dict, prefix, local_metadata, *_) -> None:
    own = [(prefix + n, p) for n, p in module._parameters.items() if p is not None]
    if own and local_metadata.get("assign_to_params_buffers", False):
        refuse(strategy, own[0][0], "assign=True would replace the Parameter objects its buffers and optimizer hold")
    writes = []
    for key, p in own:
        place = where(p)
        if isinstance(place, str):
            refuse(strategy, key, place)
        value = state_dict.get(key)
        if callable(place) and torch.is_tensor(value) and value.shape == p.shape:  # (a wrong shape: torch says so)
            writes.append((place, value))
    with torch.no_grad():
        for write, value in writes:
            write(value.detach().to(torch.float32))


def refuse(strategy: str, key: str, why: str) -> None:
    raise RuntimeError(
        f"load_state_dict() into {key!r} under {strategy}: {why}, so the loaded values would not be the ones trained. "
        f"Load the weights into the model before wrap(model, ...), or load a full checkpoint into the wrapped model: "
        f"toolkit.parallel.checkpoint.load_full(model, optimizer, path)."
    )


def into_slice(master: torch.Tensor, flat, index: int, rank: int):
    """A writer of parameter `index`'s fp32 value into `master`, this rank's slice of the flat buffer `flat`."""

    def write(value: torch.Tensor) -> None:
        for part in flat.pieces(rank):
            if part.index == index:
                whole = value.reshape(-1)[part.tensor_start : part.tensor_end]
                master.data[part.shard_start : part.shard_end].copy_(whole)

    return write
