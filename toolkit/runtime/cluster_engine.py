"""The engines' side of `toolkit.runtime.cluster`: a process group that survives a failed cell.

Engines outlive cells, so one failed cell must not poison the next. A gloo group whose collective timed
out or lost a peer is broken for good, and even a healthy one is out of step if one rank skipped a
collective the others entered. So each engine:

1. meets the others once over MPI, on a TCPStore that rank 0 hosts for the cluster's whole life;
2. initializes the default process group under a prefix of that store (generation 0);
3. after a cell that raised (IPython's `post_execute`), logs the call's id among the failed calls in the
   store and destroys its process group: its connections close, so peers blocked in a collective with it
   fail at once instead of at the timeout. A stand-in group that never connects keeps `dist.get_rank()`
   working;
4. before every cell (`pre_execute`), finds the group this call must run in: the one built after the last
   failed call *before* it. If that is not the group it has, the cell's first collective builds it first.
   Every engine of a call sees the same earlier failures, so all of them build the same new group together,
   engines whose cell succeeded included; a cell that runs no collective (on one engine, say) builds nothing.
   The engines meet in the store before they build it (`_join`): one whose cell fails before its first
   collective logs a failed call and never comes, and the others, seeing a failure of this call or a later
   one, fail at once.

A call's id is stamped by the notebook's client (`cluster._stamp_calls`), the same on every engine the call
is sent to, in the order the calls were sent. It cannot be a count each engine keeps: a call sent to one
engine moves only that one's. Nor the moment an engine reads the store: on a loaded machine one engine can
run a whole failing call before another begins it, and the slow one would count that failure as one before
the call and build a group the fast one comes to only in its next call (CI saw them wait out `timeout_s`).
A call with no id (a client the toolkit did not make) is dated when it reaches the engine, which has that
weakness. `map` sends each engine a call of its own, ids a moment apart; a join also fails at once when a
failure is logged while it waits, which covers that.

ipykernel's habit of aborting the requests queued behind a failed cell is switched off: it aborts only what
has reached each engine, so the engines would no longer run the same cells.

Functions sent with `view.apply` / `apply_sync` / `map_sync` run outside cells; the same two steps wrap
them (`_wrap_apply`), so they recover as cells do. Groups made with `dist.new_group` in earlier cells die
with their generation: make them again.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from . import raw, status
from .env import Placement, detect, mpi_store, resolve_backend

_FAILED_CALLS = "toolkit/failed-calls"  # "id," for each call that failed on an engine
CALL_ID = "toolkit_call"  # the key of a call's id in its request's metadata
_state: dict = {}


def setup(backend: str, timeout_s: float) -> Placement:
    """Run once on every engine by `cluster()`: rendezvous, first process group, cell hooks."""
    from mpi4py import MPI

    place = detect()
    if dist.is_initialized():
        return place
    comm = MPI.COMM_WORLD
    local = int(os.environ.get("MPI_LOCALNRANKS", comm.Get_size()))
    backend = resolve_backend(backend, local)
    if backend == "nccl":
        torch.cuda.set_device(place.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = mpi_store(place.world_size, timeout)
    store.append(_FAILED_CALLS, "")
    _state.update(store=store, backend=backend, place=place, timeout=timeout, generation=-1, call=0, seen=0)
    _build(0)
    raw.watch()
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        shell.events.register("pre_execute", _before_cell)
        shell.events.register("post_execute", _after_cell)
        if hasattr(shell, "kernel"):
            _run_every_cell(shell.kernel)
            _wrap_apply(shell.kernel)
    return place


def _build(generation: int) -> None:
    """The default group of this generation; every engine must call this (it connects to all of them)."""
    _join(generation)
    if dist.is_initialized():
        dist.destroy_process_group()
    _init(f"toolkit/pg/{generation}")
    _state["generation"] = generation
    status.reset()  # every rank numbers collectives from #1 again
    from ..comm import collectives

    collectives._ranks_cache.clear()  # it held the old generation's group objects


def _join(generation: int) -> None:
    """Wait until every engine has come to build this generation's group. One whose call failed before its
    first collective never comes: it logged a failed call instead, and the others stop waiting at once (in
    gloo's rendezvous they would wait out the whole timeout for it)."""
    from ..comm.handle import PeerFailed

    store, place = _state["store"], _state["place"]
    joined = f"toolkit/pg/{generation}/joined"
    store.add(joined, 1)
    give_up = time.monotonic() + _state["timeout"].total_seconds()
    while store.add(joined, 0) < place.world_size:
        failed = _failed_calls()
        if len(failed) > _state["seen"] or max(failed, default=0) > generation:
            raise PeerFailed(
                f"rank {place.rank} could not rebuild the process group after a failed cell: another "
                "rank of the group went away (it raised before its first collective of this call); "
                "look for that rank's own error."
            )
        if time.monotonic() > give_up:
            raise PeerFailed(
                f"rank {place.rank} could not rebuild the process group after a failed cell: it timed "
                "out waiting for the other ranks of the group (one finished this call without any "
                "collective, while this one entered one)."
            )
        time.sleep(0.01)


def _failed_calls() -> list[int]:
    return [int(call) for call in _state["store"].get(_FAILED_CALLS).decode().split(",") if call]


def _init(prefix: str, lazy: bool = False) -> None:
    place = _state["place"]
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if lazy else "0"  # lazy: connect on first use, never wait now
    dist.init_process_group(
        _state["backend"],
        store=dist.PrefixStore(prefix, _state["store"]),
        rank=place.rank,
        world_size=place.world_size,
        timeout=_state["timeout"],
    )


def _before_cell() -> None:
    from IPython import get_ipython

    shell = get_ipython()
    parent = shell.kernel.get_parent("shell") if hasattr(shell, "kernel") else {}
    _state["call"] = call = (parent.get("metadata") or {}).get(CALL_ID) or time.time_ns()
    failed = _failed_calls()
    _state["seen"] = len(failed)
    generation = max((f for f in failed if f < call), default=0)  # not this call's own failures: see above
    if generation != _state["generation"]:
        status.before_next_collective(lambda: _build(generation))


def _after_cell() -> None:
    from IPython import get_ipython

    _after(get_ipython().last_execution_succeeded)


def _run_every_cell(kernel) -> None:
    """After a cell raises, ipykernel aborts the requests that reach the engine before its event loop turns
    again. That window is per engine: under load, the next cell can land in it on one engine and not on the
    others, which then wait for it to rebuild the group (CI saw it). Every engine runs every cell it is sent."""
    real = kernel.shell_handlers["execute_request"]

    async def execute_request(stream, ident, parent):
        parent["content"]["stop_on_error"] = False
        return await real(stream, ident, parent)

    kernel.shell_handlers["execute_request"] = execute_request


def _wrap_apply(kernel) -> None:
    """`view.apply` / `apply_sync` / `map_sync` run a function outside any cell: give them the cells' hooks."""
    real = kernel.do_apply

    def do_apply(content, bufs, msg_id, reply_metadata):
        _before_cell()
        reply, result = real(content, bufs, msg_id, reply_metadata)
        _after(reply.get("status") == "ok")
        return reply, result

    kernel.do_apply = do_apply


def _after(succeeded: bool) -> None:
    if succeeded:
        return
    call = _state["call"]
    _state["store"].append(_FAILED_CALLS, f"{call},")
    status.before_next_collective(None)
    if dist.is_initialized():
        dist.destroy_process_group()  # closes its connections: peers waiting on this engine fail now
    _init(f"toolkit/stand-in/{call}/{_state['place'].rank}", lazy=True)
    _state["generation"] = -1


def entered(group: tuple) -> tuple[int, int]:
    """(this engine's rank, collectives it entered on `group` since its group was built): for `explain`."""
    return _state["place"].rank, status.entered(group)
