"""The body of one rank started by `toolkit.launch` (run as `python -m toolkit.runtime.worker FOLDER`)."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback


def _exit_with_parent(parent: int) -> None:
    """If the launcher dies (a notebook kernel restarted), this rank must not linger."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def _to_cpu(value):
    """Results cross to the parent, which may have no GPU: bring tensors home first."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _write(folder: str, name: str, value) -> None:
    path = os.path.join(folder, name)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".tmp", path)  # the parent never sees half a file


def _leave_together(world_size: int) -> None:
    """Wait until every rank has returned: one that exits at once (fn used no collective) would otherwise
    close its sockets while a slower peer is still connecting to it. Through the store, not a collective,
    so a rank that returned early is seen as "returned", never as inside a collective its peers skipped."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add("toolkit/returned", 1)
    while store.add("toolkit/returned", 0) < world_size:
        time.sleep(0.02)


def main(folder: str) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    rank = int(os.environ["RANK"])
    with open(os.path.join(folder, "job.pkl"), "rb") as f:
        job = pickle.load(f)  # plain values; the function itself is a second, inner pickle
    sys.path[:] = job["sys_path"] + [p for p in sys.path if p not in job["sys_path"]]
    is_consequence = None  # known once toolkit is imported
    try:
        import torch
        import torch.distributed as dist

        from toolkit.runtime import blame, by_value, env, raw, stacks, status

        is_consequence = blame.is_consequence
        stacks.arm(folder, rank)  # the launcher can ask where this rank's Python code is
        by_value.register(job.get("sources", {}))  # tracebacks show the caller's file, line and source
        torch.set_num_threads(job["threads"])
        status.attach(status.board_path(folder, rank))
        env.init(job["backend"], timeout_s=job["timeout_s"])
        raw.watch()
        fn, args = pickle.loads(job["payload"])  # may import the caller's modules: needs its sys.path
        result = fn(*args)
        _write(folder, f"result-{rank}.pkl", _to_cpu(result))
        _leave_together(dist.get_world_size())
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        consequence = is_consequence is not None and is_consequence(exc)
        _write(
            folder,
            f"error-{rank}.pkl",
            {
                "type": type(exc).__name__,
                "message": str(exc),
                "time": time.time(),
                "consequence": consequence,
                "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            },
        )
        sys.stdout.flush()
        os._exit(1)  # skip teardown: peers may be gone, and destroying the group could hang
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
