"""The submission's side of a grading: the ranks that run a student's code, and nothing that judges it.

The launcher (`launcher.py`) starts the ranks with `rank_main`, in the grading's folder. In order:
1. each rank reads what the grader wrote for it alone (its token for the grader's relay), removes it, and waits
   for its peers to have done the same; it connects to the relay (`relay.py`), which hands it each check's
   inputs and takes each result; it trades its process group for the relay (`relay_group.py`: in a lab of
   point-to-point messages no collective is left in the process; elsewhere the relay carries and computes every
   collective, `relay_collectives.py`), so nothing but the relay connects the ranks;
   it confines itself further (its peers' inputs and the grader's files are out of reach; no
   new socket either: `seccomp.py`), takes its limits, notes any call to the lab's answers
   (`delegation.py`), says it is ready (to the relay), and only then imports the student's file, with the
   watchdog running;
2. for each check, every rank runs the lab's task on its inputs (taken from the relay once the previous result is
   in) and hands what it observed to the relay through the narrow channel (`wire.py`), and writes it, one file
   per check and rank; a task that raises hands in the error instead. The relay's record of who took and handed
   in what is the grader's own clock of the checks (`overseer.py`): no file a rank writes moves it.
What this process writes is read by the grader as untrusted: observations to judge, text to quote.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import time
import traceback

PATIENCE_AFTER_FAILURE_S = 1.5  # how long a rank whose task failed waits for its peers before giving up
IMPORT = "import"  # the result "check" every rank writes once the student's file is imported (or not)


def result_path(folder: str, index, rank: int) -> str:
    return os.path.join(folder, f"check-{index}-rank-{rank}.json")


def inputs_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank-{rank}.json")


def load_module(path, name: str):
    """Import a Python file as a module (the student's file, the lab's tasks)."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}: is it a Python file?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # some code (dataclasses, pickling) looks itself up there
    spec.loader.exec_module(module)
    return module


def explain(exc: BaseException, solution: str, disk_mb: float | None = None) -> str:
    """The exception in a student's words, with the line of their file where it happened. `disk_mb`: what the
    grading's folders hold, where they lie on volumes of their own (`volume.py`)."""
    from .volume import MAX_FILES, full
    from .watchdog import out_of_memory

    cause = exc
    while cause is not None and not isinstance(cause, NotImplementedError):
        cause = cause.__cause__  # the collectives door wraps what an implementation raised
    if cause is not None:
        return f"not implemented yet ({cause})" if str(cause) else "not implemented yet"
    if isinstance(exc, SystemExit):
        text = f"your code called sys.exit({exc.code!r}) (or raised SystemExit): a check cannot end that way"
    else:
        text = f"{type(exc).__name__}: {exc}".strip()
    if out_of_memory(exc):
        text = (
            "ran out of memory: the rank tried to allocate more than a check may use "
            f"(the grader's memory limit). {text.splitlines()[0][:200]}"
        )
    if disk_mb is not None and full(exc):
        text = (
            f"the grading's folders are full: your working folder and TMPDIR may hold at most {disk_mb:g} MiB and "
            f"{MAX_FILES} files in all (the grader's disk limit). {text.splitlines()[0][:200]}"
        )
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == solution]
    if mine:
        text += f"\n  at {os.path.basename(solution)} line {mine[-1].lineno}: {(mine[-1].line or '').strip()}"
    return text[:4000]


def _write(path: str, data: bytes) -> None:
    with open(path + f".tmp{os.getpid()}", "wb") as f:
        f.write(data)
    os.replace(path + f".tmp{os.getpid()}", path)  # readers never see half a file


def _wait_for_peers(folder: str, index, world_size: int, patience_s: float | None) -> bool:
    """Wait until every rank has written its result of `index`; False if patience ran out."""
    deadline = None if patience_s is None else time.monotonic() + patience_s
    while not all(os.path.exists(result_path(folder, index, r)) for r in range(world_size)):
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _store_barrier(key: str, world_size: int) -> None:
    """Every rank got here (through the store, not a collective the watchdog would count)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    while store.add(key, 0) < world_size:
        time.sleep(0.01)


def _take_inputs(spec: dict, rank: int):
    from . import wire

    path = inputs_path(spec["inputs"], rank)
    with open(path, "rb") as f:
        given = wire.decode(f.read())
    os.remove(path)  # gone before any student code runs on any rank
    return given


def rank_main(spec: dict) -> None:
    """The body of every rank (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from ..runtime import status
    from . import contract, delegation, relay_group, sandbox, seccomp, wire
    from .on_rank import Rank
    from .relay_collectives import CollectiveGroup
    from .watchdog import Watchdog

    rank, world_size = dist.get_rank(), dist.get_world_size()
    given = _take_inputs(spec, rank)
    _store_barrier("grading/inputs-taken", world_size)
    link = relay_group.connect(spec["relay"], rank, given.pop("relay"))  # each check's inputs, and its result
    messages_only = bool(spec.get("messages_only"))
    # no process group of its own: the grader carries its messages (a point-to-point lab) or its collectives too
    relay_group.switch(link, rank, world_size, relay_group.RelayGroup if messages_only else CollectiveGroup)
    sandbox.confine(spec["read"], [spec["out"], spec["work"], spec["tmp"]], spec["hidden"], no_tcp=True)
    seccomp.no_new_channels()
    limits, out, solution = spec["limits"], spec["out"], spec["student"]
    disk_mb = limits.get("disk_limit_mb") if spec.get("volume") else None  # a full folder is then the cap's
    watchdog = Watchdog(
        out, rank, world_size, solution, lambda i, r: result_path(out, i, r), limits["stall_s"], limits["time_limit_s"]
    )
    delegation.watch(spec["answers"], solution)
    tasks = load_module(spec["tasks"], "lab_tasks")
    sandbox.limit(limits["memory_limit_mb"])
    relay_group.ready(link)  # to the grader, which alone keeps it: no file a submission could remove
    watchdog.begin(IMPORT)
    try:
        student = load_module(solution, "submission")
        failed = ""
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: a submission does not end the grading
        student, failed = None, f"your file does not import: {explain(exc, solution, disk_mb)}"
    _write(result_path(out, IMPORT, rank), wire.encode({"error": failed, "delegated": delegation.take()}))
    watchdog.end()
    if failed or not _wait_for_peers(out, IMPORT, world_size, None):
        return
    for index in spec["indices"]:
        group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=limits["check_timeout_s"]))
        torch.manual_seed(1000 + rank)
        status.enter(f"check {index}")
        watchdog.begin(index)
        try:  # the task once per case, each answer under its case's id (contract.py)
            inputs = relay_group.inputs(link, index)
            done, case, exc = contract.run_cases(
                getattr(tasks, spec["tasks_of"][str(index)]),
                student,
                Rank(rank, world_size, group, None if messages_only else link),
                inputs,
            )
        except BaseException as error:  # noqa: BLE001 - inputs tampered with: no case to name
            done, case, exc = [], None, error
        observed = {"ok": done}
        failed = f"rank {rank}{contract.in_case(case)}: {explain(exc, solution, disk_mb)}" if exc is not None else ""
        exc = None  # its traceback holds the task's frames, and what they hold (a check that ate the memory)
        observed.update(error=failed, delegated=delegation.take(), time=time.time())
        try:
            data = wire.encode(observed)
        except Exception as exc:  # noqa: BLE001 - e.g. a student's object that cannot even be described
            data = wire.encode({"error": f"rank {rank}: the task's result cannot be sent ({exc})", "time": time.time()})
        if len(data) > wire.MAX_BYTES:
            data = wire.encode(
                {
                    "error": f"rank {rank}: the task's result is {len(data)} bytes, more than the {wire.MAX_BYTES} "
                    "one answer may hold",
                    "time": time.time(),
                }
            )
        status.leave()
        relay_group.hand_in(link, data)
        _write(result_path(out, index, rank), data)
        watchdog.end()
        # No board entry while waiting: a peer that never finishes is inside its check (the launcher
        # sees that one hang) or dead (the launcher sees that too).
        if not _wait_for_peers(out, index, world_size, PATIENCE_AFTER_FAILURE_S if failed else None):
            _write(os.path.join(out, "abandoned.json"), json.dumps({"index": index}).encode())
            raise RuntimeError(
                f"check {index} failed on rank {rank} while other ranks were still inside it; stopping this launch"
            )
