"""Where a submission runs: processes that see nothing of the grader, a filesystem of a few folders, limits set
before any of its code runs, and the toolkit without the lab's answers.

The grader describes a launch's sandbox in its spec (`session.launch_ranks`); the first process of the launch
enters it (`enter`) before it runs anything else, and everything it starts inherits it. Layers, each used where
the machine allows it, and named in the report (`describe`):

- **namespaces** (`namespaces.py`): a PID namespace whose /proc shows only the launch's processes, a mount
  namespace with a private /tmp and /dev/shm, an IPC namespace (where the kernel refuses them, /dev/shm is not
  writable under landlock, and what the sandbox's user left in the shared folders is removed after: `sweep`);
- **landlock** (`landlock.py`, Linux 5.13+): read only the system, Python, the students' build of the toolkit
  (`student_wheel.for_lab`) and the grading's code; write only the grading's folder. Never readable, wherever it
  lies (even under a readable tree such as /opt or a site-packages): a full toolkit, with the answers, and the
  lab folder (solutions, hidden checks);
- **another user** (when grading as root, as Gradescope does): the submission runs as `nobody`. Where that
  user cannot reach the interpreter (a Python under /root), the mount namespace makes it reachable; where no
  namespace can, the grading is refused with a message saying what to change (`preflight`), never run as root;
- **limits** set by the launch's first process before any code of the launch runs, hard (no process below can
  raise them): CPU seconds (RLIMIT_CPU), the size of a file (and of the grading's folders in all, where they lie
  on volumes of their own: `volume.py`), no core files; each rank's memory (RLIMIT_DATA)
  before the submission is imported (`limit`). The
  grader watches what no limit of the kernel covers: wall-clock time, the volume printed, the number of
  processes (`session.py`).

Standard library only: the graders' fork server loads it (and its three siblings) by path.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import resource
import shutil
import site
import sys
from pathlib import Path

try:
    from . import landlock, namespaces, volume
except ImportError:  # loaded by path, by the graders' fork server, which imports nothing of the toolkit

    def _sibling(name: str):
        spec = importlib.util.spec_from_file_location(
            f"_toolkit_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py")
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    landlock, namespaces, volume = _sibling("landlock"), _sibling("namespaces"), _sibling("volume")

NOBODY = "nobody"
FILE_SIZE_LIMIT = 256 * 2**20  # no file a submission writes needs more
SYSTEM_READ = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/opt", "/proc", "/sys", "/dev")
DEVICES_RW = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/tty")
PRIVATE_TMP = "private /tmp and /dev/shm"  # what namespaces.enter says when the launch has its own /dev/shm


class Unsafe(RuntimeError):
    """This machine cannot give a submission the sandbox the grader promises: nothing is run."""


def landlock_abi() -> int:
    return landlock.abi()


# --- paths ---------------------------------------------------------------------------------------------------
def packages() -> set[str]:
    """The toolkit's package folders: this file's (it may be loaded by path), and the one `import toolkit` finds
    from here (another, where a grader runs from a checkout beside the installed toolkit)."""
    found = {str(Path(__file__).resolve().parent.parent)}
    try:
        spec = importlib.util.find_spec("toolkit")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        found.add(str(Path(spec.origin).resolve().parent))
    return found


def python_paths() -> list[str]:
    """What running Python needs to read: the interpreter, its libraries, site-packages (a toolkit installed
    there stays hidden: `toolkits`)."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(sys.executable).resolve().parent)}
    found.update(site.getsitepackages())
    for entry in sys.path:  # an installed package's folder, never a folder that holds a checkout
        if entry and ("site-packages" in entry or "dist-packages" in entry):
            found.add(entry)
    return sorted(p for p in found if p and os.path.exists(p))


def toolkits() -> list[str]:
    """Every toolkit package (with the labs' answers) a sandbox might otherwise read: the one the grader runs,
    and any installed in a site-packages of this interpreter or of the system."""
    found = set(packages())
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr", "/usr/local", *python_paths()}
    for root in roots:
        for pattern in (
            "toolkit",
            "lib/python3*/*-packages/toolkit",
            "lib/python3/dist-packages/toolkit",
            "local/lib/python3*/*-packages/toolkit",
        ):
            found.update(p for p in glob.glob(os.path.join(root, pattern)) if os.path.isfile(f"{p}/grading/grader.py"))
    return sorted(os.path.realpath(p) for p in found)


# --- another user --------------------------------------------------------------------------------------------
def other_user() -> tuple[int, int] | None:
    """(uid, gid) the submission runs as when we are root (`nobody`, or TOOLKIT_GRADING_USER), else None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    name = os.environ.get("TOOLKIT_GRADING_USER", NOBODY)
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise Unsafe(
            f"grading as root, a submission runs as the user {name!r}, and this machine has no such user: "
            "create it (useradd --system --no-create-home nobody), or name another unprivileged user in "
            "TOOLKIT_GRADING_USER. Nothing was run."
        ) from None
    if entry.pw_uid == 0:
        raise Unsafe(f"TOOLKIT_GRADING_USER={name} is root: a submission must run as an unprivileged user.")
    return entry.pw_uid, entry.pw_gid


def preflight(user, reach: list[str], made: list[str]) -> None:
    """Refuse (Unsafe) to grade as root where the submission's user cannot reach what it must run (`reach`:
    the interpreter, its libraries) and no mount namespace can make it reachable (`made`: what `namespaces.probe`
    found this machine allows)."""
    walls = namespaces.blocked(reach, user)
    if not walls or namespaces.OWN_PIDS in made:
        return
    name = os.environ.get("TOOLKIT_GRADING_USER", NOBODY)
    where = "; ".join(f"{folder} (it holds {', '.join(paths)})" for folder, paths in walls.items())
    raise Unsafe(
        f"grading as root, a submission runs as {name!r}, who cannot enter {where}, and this machine allows no "
        "mount namespace that would make the interpreter reachable (no CAP_SYS_ADMIN here?). The grading stops "
        f"rather than run the submission as root. Install Python where every user can read it (/usr, /opt, or a "
        f"virtual environment made from such a Python), or let others enter the folder (chmod o+x "
        f"{' '.join(walls)}), or name in TOOLKIT_GRADING_USER a user who can run {sys.executable}. Nothing was run."
    )


def hand_over(paths, user) -> None:
    """Give the folders the submission writes to its user (root only); a link in them is never followed."""
    if user is None:
        return
    for path in paths:
        for root, dirs, files in os.walk(path):
            for name in [root] + [os.path.join(root, n) for n in dirs + files]:
                os.chown(name, *user, follow_symlinks=False)


def sweep(user, folders=("/dev/shm", "/tmp", "/var/tmp")) -> list[str]:
    """Remove what `user` left in the machine's shared folders (a launch without namespaces of its own wrote
    there as the sandbox's user: a channel to the next grading). Returns what it removed."""
    removed = []
    if user is None:
        return removed
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != user[0]:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(entry.path)
            except OSError:
                pass
    return removed


def become(user) -> None:
    """Drop root for good: this process and its children are `user` from now on."""
    if user is None:
        return
    uid, gid = user
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


# --- limits ------------------------------------------------------------------------------------------------
def _set(kind, value: int) -> None:
    """Soft and hard limit `value` (or lower, where the hard limit is): no process below can raise it again."""
    soft, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def launch_limits(cpu_s: float) -> None:
    """For this process and every one it starts, hard: `cpu_s` CPU seconds each (SIGXCPU, then SIGKILL 5 s later),
    no file over FILE_SIZE_LIMIT, no core file."""
    if not sys.platform.startswith("linux"):
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    cpu = int(cpu_s) + 1
    if hard != resource.RLIM_INFINITY:
        cpu = min(cpu, max(hard - 5, 1))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5 if hard == resource.RLIM_INFINITY else min(cpu + 5, hard)))
    _set(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT)
    _set(resource.RLIMIT_CORE, 0)


def _data_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def limit(memory_limit_mb: float | None) -> None:
    """On a rank, before the submission is imported, hard: at most `memory_limit_mb` MiB more data (RLIMIT_DATA:
    the heap and torch's tensors, every thread's stack). Processes are counted by the grader (`overseer.py`), not
    by RLIMIT_NPROC: that counts every process of the user on the machine, and `nobody` runs every grading's ranks
    (a class graded with --jobs, other courses' graders): another grading's ranks would use up this one's."""
    if sys.platform.startswith("linux") and memory_limit_mb:
        _set(resource.RLIMIT_DATA, _data_bytes() + int(memory_limit_mb * 2**20))


# --- the sandbox ---------------------------------------------------------------------------------------------
def confine(read: list, write: list, hidden: list = (), shm: bool = True, no_tcp: bool = False) -> bool:
    """Landlock: the system, Python and `read` to read (but what lies in `hidden`), `write` and a few devices to
    write, and /dev/shm with `shm` (in a launch without a /dev/shm of its own it is the machine's, shared with
    every other grading: not writable); with `no_tcp`, no TCP socket bound or connected. False where landlock
    is unavailable."""
    devices = DEVICES_RW + (("/dev/shm",) if shm else ())
    return landlock.restrict(
        list(SYSTEM_READ) + python_paths() + [str(p) for p in read],
        [str(p) for p in write] + [d for d in devices if os.path.exists(d)],
        hidden=[str(h) for h in hidden],
        no_tcp=no_tcp,
    )


def enter(spec: dict) -> list[str]:
    """Enter the sandbox `spec` describes (from `session.launch_ranks`): namespaces (this process may fork: it
    then returns in the child, the namespaces' first process), the launch's limits, its user, and landlock.
    What starts a launch does this first, single-threaded; everything it starts inherits it. Returns what the
    namespaces made (see `namespaces.enter`)."""
    user = tuple(spec["user"]) if spec["user"] else None
    if spec.get("volume"):  # first: the grading's folders on their volumes (`volume.py`), then the launch's own
        volume.join(spec["volume"])
    made = namespaces.enter(spec["box"], user, spec["reach"]) if spec["namespaces"] else []
    launch_limits(spec["cpu_s"])
    become(user)
    if (made or spec.get("volume")) and os.getuid() != 0:
        namespaces.drop_capabilities()  # a user namespace's, which a submission must not have
    unreachable = [p for p in spec["reach"] if os.path.exists(p) and not os.access(p, os.R_OK)]
    if unreachable:
        raise Unsafe(f"the sandbox's user cannot read {', '.join(unreachable)}: nothing was run")
    confine(
        spec["read"], [spec["out"], spec["work"], spec["tmp"], spec["inputs"]], spec["hidden"], shm=PRIVATE_TMP in made
    )
    return made


def describe(made: list[str] | None = None) -> str:
    """The protections this machine gives a submission, in a few words (the report prints them)."""
    made = namespaces.probe() if made is None else made
    parts = ["own processes", "time, memory, process and output limits"]
    if made:
        parts.append("namespaces (" + ", ".join(m for m in made if "covered" not in m) + ")")
    if landlock.abi() >= 1:
        parts.append(f"filesystem sandbox (landlock ABI {landlock.abi()})")
    if os.geteuid() == 0:
        parts.append(f"runs as {os.environ.get('TOOLKIT_GRADING_USER', NOBODY)}")
    return ", ".join(parts)


def isolated() -> bool:
    """True when a submission cannot read the instructor's files (landlock, or another user)."""
    return landlock.abi() >= 1 or (hasattr(os, "geteuid") and os.geteuid() == 0)
