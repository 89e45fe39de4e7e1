"""Raw `torch.distributed` collectives on the status board, so a hang in `dist.all_reduce` is seen too.

`watch()` (called by `toolkit.launch`'s ranks and the cluster's engines) replaces the collectives in
the `torch.distributed` namespace with thin wrappers that number and post each call, as the toolkit's
own door does (`comm.collectives`), then call torch's function. A call made from inside the door is
not posted twice.

What stays unseen, because torch offers no hook for it on gloo:
- `isend`/`irecv`/`batch_isend_irecv` (`P2POp` accepts only torch's own functions, so they are left alone);
- functional collectives and DTensor (they go through `torch.ops`), and `ProcessGroup` methods called directly;
- a function imported by name (`from torch.distributed import all_reduce`) before `watch()` ran;
- `async_op=True` calls are posted when issued, not while their `wait()` blocks.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist

from . import status

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
)


def watch() -> None:
    """Wrap torch.distributed's collectives (once per process)."""
    for name in COLLECTIVES:
        real = getattr(dist, name, None)
        if real is not None and not hasattr(real, "toolkit_real"):
            setattr(dist, name, _posting(name, real))


def _posting(name: str, real):
    signature = inspect.signature(real)

    @functools.wraps(real)
    def call(*args, **kwargs):
        if status.busy() or not dist.is_initialized():
            return real(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        entry = status.begin(name, _ranks(name, given), _detail(given))
        try:
            out = real(*args, **kwargs)
        except BaseException:
            status.fail(entry)
            raise
        status.end(entry)
        return out

    call.toolkit_real = real
    return call


def _ranks(name: str, given: dict) -> list[int]:
    if name in ("send", "recv"):
        peer = given.get("dst", given.get("src"))
        return sorted({dist.get_rank(), peer}) if peer is not None else [dist.get_rank()]
    return dist.get_process_group_ranks(given.get("group") or dist.group.WORLD)


def _detail(given: dict) -> str:
    tensor = next((v for v in given.values() if isinstance(v, torch.Tensor)), None)
    shape = f", {tensor.numel()} x {str(tensor.dtype).replace('torch.', '')}" if tensor is not None else ""
    return f"raw torch.distributed{shape}"
