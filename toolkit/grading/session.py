"""The grader's side of one launch: the submission's ranks started and stopped in the grading's folder (`box.Box`),
and what they sent read back as untrusted data.

`launch_ranks` starts the grader's relay (`relay.py`: it hands the ranks each check's inputs, takes their
results, and is the overseer's clock), writes each rank's token and a spec, has the grading's fork server (one
per Box, forked by the graders' server `forkserver.py`, with the grading's id in its environment) fork the
launch's sandbox and launcher (or starts the launcher as an isolated interpreter where none can serve), waits
(never longer than its deadline), then makes sure nothing it started is alive before reading a single file back. Every
file is read with `wire.decode` or as capped text: a rank's output can fail a check, never pass one or
crash the grader.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..runtime import interrupts
from ..runtime.zygote_link import ZygoteError
from . import isolation, sandbox, student_wheel, untrusted, volume, wire
from .box import Box
from .limits import Limits
from .overseer import GRACE_S, STARTUP_S, Overseer
from .relay import Relay
from .runner import IMPORT, inputs_path, result_path

# The launcher as a fresh interpreter starts as the grader's user, outside the sandbox it then enters: isolated
# (-I: no current folder, no user site-packages and no PYTHON* variable decide what it imports, since the
# submission writes its working folder and HOME), with the students' toolkit alone put first on its path.
LAUNCHER = "import sys; sys.path.insert(0, sys.argv.pop(1)); import toolkit.grading.launcher as m; sys.exit(m.main())"

KEEP_ENV = ("PATH", "LANG", "LC_ALL", "VIRTUAL_ENV", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
TEXT_LIMIT = 20_000


@dataclass
class Launch:
    """What one launch left behind, read back: results[index][rank] (decoded, or a WireError's text under
    "error"), the watchdogs' verdict, the launcher's story, the ranks' last printed lines."""

    results: dict = field(default_factory=dict)
    stuck: dict | None = None
    abandoned: object = None
    error: dict | None = None
    lines: list = field(default_factory=list)
    overran: bool = False
    ready: bool = True  # every rank got as far as importing the student's file
    relayed: dict | None = None  # relayed[index][rank]: the messages (or collectives) the grader's relay carried
    relayed_kind: str = "messages"

    def of_rank(self, rank: int, count: int = 3) -> list[str]:
        prefix = f"[rank {rank}] "
        return [line[len(prefix) :] for line in self.lines if line.startswith(prefix)][-count:]


def _env(box: Box, grading_id: str) -> dict:
    """The launch's whole environment: a few of the grader's variables (never its secrets), the grading's id and
    folders, and the students' toolkit first on the path."""
    env = {k: v for k, v in os.environ.items() if k in KEEP_ENV}
    env.update(
        {
            isolation.MARKER: grading_id,
            "HOME": str(box.work),
            "TMPDIR": str(box.tmp),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONSAFEPATH": "1",  # never the working folder on a path: the submission writes there
            "PYTHONNOUSERSITE": "1",  # nor HOME's site-packages (HOME is that folder): no .pth of its own runs
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    env["PYTHONPATH"] = str(box.lib)
    return env


def _stop(process, grading_id: str, spare=()) -> None:
    """The launcher first (its keeper then stops the ranks), then everything that carries the id (but the fork
    server, which does for its children's sake). `process`: a Popen, or the server's handle on what it forked."""
    for sig, patience in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=patience)
        except subprocess.TimeoutExpired:
            pass
    isolation.stop(grading_id, spare=spare)
    process.wait()


def _read(path: Path):
    """What a rank left at `path`, decoded (never through a link, never more than one answer's bytes)."""
    try:
        return _decoded(untrusted.read(path, wire.MAX_BYTES, what="a result"))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return {"error": f"sent something the grader cannot read ({exc})", "time": 0.0}


def _decoded(data: bytes):
    try:
        return wire.decode(data)
    except wire.WireError as exc:
        return {"error": f"sent something the grader cannot read ({exc})", "time": 0.0}


def _text(path: Path) -> str:
    return untrusted.tail(path, TEXT_LIMIT).decode(errors="replace")


def launch_ranks(
    box: Box,
    n: int,
    indices: list,
    tasks_of: dict,
    inputs: dict,
    answers: list,
    limits: Limits,
    *,
    backend: str,
    quiet: bool,
    grading_id: str,
    messages_only: bool = False,
) -> Launch:
    """Run the tasks of checks `indices` on n ranks of the submission; read back what they left. The grader's relay
    (`relay.py`) hands them each check's inputs and takes their results; with messages_only, the ranks also talk
    through it (and it records what it carried). A Ctrl-C acts at once while the ranks run; elsewhere it waits until
    what the launch started is stopped (`runtime/interrupts.py`): none lands between forking the launcher and its
    handle being held here."""
    box.fresh_out()
    sent, handed = {str(i): [wire.encode(inputs[i][r]) for r in range(n)] for i in indices}, box.seen(box.inputs)
    with interrupts.held():
        relay = Relay(str(box.root), n, indices, sent)
        try:
            for rank in range(n):
                Path(inputs_path(str(handed), rank)).write_bytes(wire.encode({"relay": relay.tokens[rank]}))
            sandbox.hand_over([handed], box.user)
            found = _launch(
                box, n, indices, tasks_of, answers, limits, backend, quiet, grading_id, relay, messages_only
            )
        finally:
            relay.close()
    carried = relay.record if messages_only else relay.collectives  # what the relay carried: messages or collectives
    found.relayed = {index: {r: carried[r].get(str(index), []) for r in range(n)} for index in indices}
    found.relayed_kind = "messages" if messages_only else "collectives"
    for index in indices:  # the results as the ranks first handed them in
        for r, data in relay.results.get(str(index), {}).items():
            found.results[index][r] = _decoded(data)
    return found


def _launch(
    box: Box,
    n: int,
    indices: list,
    tasks_of: dict,
    answers: list,
    limits: Limits,
    backend: str,
    quiet: bool,
    grading_id: str,
    relay: Relay,
    messages_only: bool,
) -> Launch:
    order = [IMPORT] + list(indices)
    deadline = len(order) * (limits.time_limit_s + GRACE_S) + STARTUP_S
    spec = {
        "world_size": n,
        "indices": indices,
        "tasks_of": {str(i): tasks_of[i] for i in indices},
        "code": str(box.code),
        "student": str(box.student),
        "tasks": str(box.tasks),
        "inputs": str(box.inputs),
        "out": str(box.out),
        "work": str(box.work),
        "tmp": str(box.tmp),
        "answers": list(answers),
        "limits": asdict(limits),
        "backend": backend,
        "user": list(box.user) if box.user else None,
        "box": str(box.root),
        "lib": str(box.lib),
        "namespaces": box.namespaces,
        "read": [str(box.code), str(box.lib)],
        "reach": sandbox.python_paths(),
        "hidden": hidden_from(box),
        "cpu_s": deadline * max(1, (os.cpu_count() or 1) // n),
        "relay": relay.path,
        "volume": None if box.volume is None else box.volume.pid,  # the namespace its folders' volumes are in
        "messages_only": messages_only,
    }
    spec_path = box.root / f"spec-{n}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = box.root / f"log-{n}.txt"
    env = _env(box, grading_id)
    output, ranks_output = os.pipe()  # what the launch prints comes to this process alone (the overseer)
    try:
        with open(log_path, "wb") as log:
            try:
                process, server = _start_launcher(box, env, spec_path, ranks_output, quiet)
            finally:
                os.close(ranks_output)
            spare = {server.process.pid} if server else set()
            try:
                with interrupts.taken():  # the wait for the ranks
                    verdict = Overseer(
                        process, output, log, relay, n, order, limits, grading_id, spare, None if quiet else sys.stdout
                    ).run()
            finally:
                _stop(process, grading_id, spare=spare)
    finally:
        os.close(output)
    found = Launch(
        overran=verdict is not None and verdict["index"] is None,
        lines=[line for line in _text(log_path).splitlines() if line.strip()][-400:],
    )
    out = box.seen(box.out)
    for index in order:
        found.results[index] = {
            r: v for r in range(n) if (v := _read(Path(result_path(str(out), index, r)))) is not None
        }
    found.ready = relay.all_ready()  # said by each rank just before it imported the submission, to the relay
    stuck = _read(out / "deadlock.json")  # the ranks' watchdog, with the line each was on; else the overseer's
    stuck = (
        stuck
        if isinstance(stuck, dict) and "index" in stuck and isinstance(stuck.get("message"), str)
        else verdict
        if verdict is not None and verdict["index"] is not None
        else None
    )
    found.stuck = stuck
    abandoned = _read(out / "abandoned.json")
    found.abandoned = abandoned.get("index") if isinstance(abandoned, dict) else None
    told = _read(out / "launch.json")
    error = told.get("error") if isinstance(told, dict) else None
    found.error = error if isinstance(error, dict) and isinstance(error.get("message"), str) else None
    return found


def hidden_from(box: Box) -> list[str]:
    """What the sandbox must never read, wherever it lies (a readable tree may hold it): every toolkit with the
    labs' answers, the students' toolkits built for the other labs (each keeps this lab's answers: the ranks read
    the copy in the grading's folder), and the lab's folder with those beside it (solutions, hidden checks)."""
    lab = box.lab_dir.resolve()
    labs = {str(lab)} | (
        {str(lab.parent)}
        if any((p / "checks.py").is_file() for p in lab.parent.iterdir() if p != lab and p.is_dir())
        else set()
    )
    builds = {str(student_wheel.CACHE.resolve())} if student_wheel.CACHE.is_dir() else set()
    root = str(box.root.resolve())
    found = set(sandbox.toolkits()) | labs | builds
    return sorted(p for p in found if not (root + "/").startswith(p.rstrip("/") + "/"))


def launcher_command(lib, spec_path) -> list[str]:
    """The launcher as a fresh interpreter: isolated (`LAUNCHER`), importing the students' toolkit at `lib`."""
    return [sys.executable, "-I", "-c", LAUNCHER, str(lib), str(spec_path)]


def _start_launcher(box: Box, env: dict, spec_path: Path, output: int, quiet: bool):
    """The launch's launcher, forked inside its sandbox by the grading's fork server (no interpreter to start,
    no torch to import), or else a fresh interpreter running `toolkit.grading.launcher` (`LAUNCHER`): (its handle,
    the server or None).
    Its stdout and stderr are `output` (the writing end of the overseer's pipe)."""
    server = box.fork_server(env)
    if server is not None:
        try:
            return server.fork({"spec": str(spec_path), "env": env, "cwd": str(box.work)}, [output]), server
        except ZygoteError as exc:
            box.server, box.serverless = None, f"the grading's fork server failed ({exc})"
            server.close()
    if box.serverless and not quiet:
        print(f"grading: {box.serverless}: each launch starts its launcher as a fresh interpreter", file=sys.stderr)
    command = launcher_command(box.lib, spec_path)
    return subprocess.Popen(
        command if box.volume is None else volume.entering(box.volume.pid, command),
        cwd=box.work,
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
    ), None
