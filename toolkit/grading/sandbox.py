"""Where a submission runs: a folder of its own, limits from the moment it is imported, and (on Linux)
a filesystem it cannot see past.

Three layers, each used where the machine allows it, and named in the report (`describe()`):

- **landlock** (Linux 5.13+, no privileges needed): the process and everything it starts may read only
  the system, Python and the toolkit's package, and write only inside the grading's own folder. The
  instructor's labs (solutions, hidden checks), other students' files and the grader's results are out of
  reach; so are ptrace and (ABI 6+) signals to any process outside the sandbox.
- **another user** (when grading as root, as Gradescope does): the submission runs as `nobody`, so
  files only root may read stay unread, and it cannot signal or trace the grader.
- **resource limits** (everywhere): memory (RLIMIT_DATA: the data a rank may allocate beyond what it
  holds when the submission is imported), processes (RLIMIT_NPROC, as `nobody`), file size, no core files.

Without landlock and without root, a submission still runs in processes of its own with the limits, but
can read what the user running the grader can: `describe()` says so, and `--class` refuses unless told.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import pwd
import resource
import site
import stat
import sys
from pathlib import Path

NOBODY = "nobody"
FILE_SIZE_LIMIT = 256 * 2**20  # no file a submission writes needs more
# landlock: syscall numbers (the same on every architecture), rights, rule type
_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446
_PATH_BENEATH, _NO_NEW_PRIVS = 1, 38
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_ALL_V1 = (1 << 13) - 1  # execute .. make_sym
_FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | (1 << 14) | (1 << 15)  # + truncate, ioctl_dev
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2
READ = EXECUTE | READ_FILE | READ_DIR
SYSTEM_READ = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/opt", "/proc", "/sys", "/dev")
DEVICES_RW = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/shm", "/dev/tty")


class _Ruleset(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's landlock ABI version, 0 where there is none (not Linux, too old, or disabled)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64", "riscv64"):
        return 0
    try:
        version = _libc().syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(0, int(version))


def _rights(abi: int) -> int:
    return _ALL_V1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)


def restrict(read: list, write: list, listable: list = (), abi: int | None = None) -> bool:
    """From now on this process and its children may only read `read`, read-write `write`, and list the
    folders `listable` (their names, not their files' content) (landlock). Returns False (and changes
    nothing) where the kernel has no landlock."""
    abi = landlock_abi() if abi is None else abi
    if abi < 1:
        return False
    libc, handled = _libc(), _rights(abi)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _Ruleset(handled, 0, (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0)
    fd = libc.syscall(_CREATE, ctypes.byref(ruleset), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return False
    try:
        for paths, allowed in ((listable, READ_DIR), (read, READ), (write, handled)):
            for path in paths:
                _allow(libc, fd, path, allowed & handled)
        if libc.prctl(_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_RESTRICT, fd, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)
    return True


def _allow(libc, ruleset_fd: int, path, allowed: int) -> None:
    try:
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # not on this machine: nothing to allow
    try:
        if not os.path.isdir(path):
            allowed &= _FILE_ONLY
        rule = _PathBeneath(allowed, target)
        if libc.syscall(_ADD_RULE, ruleset_fd, ctypes.c_int(_PATH_BENEATH), ctypes.byref(rule),
                        ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
    finally:
        os.close(target)


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
    """What running Python and the toolkit needs to read: the interpreter, its libraries, site-packages, and
    the toolkit's own package folder (not the folder above it: in a checkout that holds labs/)."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, *packages(), str(Path(sys.executable).resolve().parent)}
    found.update(site.getsitepackages())
    for entry in sys.path:  # an installed package's folder, never a folder that holds a checkout
        if entry and ("site-packages" in entry or "dist-packages" in entry):
            found.add(entry)
    return sorted(p for p in found if p and os.path.exists(p))


def confine(readable: list, writable: list) -> bool:
    """The sandbox for a submission's processes: the system, Python, toolkit and `readable` to read,
    `writable` and a few devices to write. False where landlock is unavailable."""
    return restrict(list(SYSTEM_READ) + python_paths() + [str(p) for p in readable],
                    [str(p) for p in writable] + [d for d in DEVICES_RW if os.path.exists(d)],
                    # the folder above the toolkit is on sys.path: Python must list it to find the package there
                    listable=[str(Path(p).parent) for p in packages()])


def enter(spec: dict) -> None:
    """The sandbox of one launch (its `spec`, from `session.launch_ranks`): become its user, then see only its
    folders. What starts a grading's ranks does this first, and everything it starts inherits it."""
    become(tuple(spec["user"]) if spec["user"] else None)
    confine(readable=[spec["code"], spec["inputs"]], writable=[spec["out"], spec["work"], spec["tmp"], spec["inputs"]])


# --- another user ----------------------------------------------------------------------------------------
def _open_to_others(path: str) -> bool:
    """Anyone may read `path` (every folder above it may be entered, and it may be read)."""
    p = Path(path).resolve()
    try:
        if not p.stat().st_mode & stat.S_IROTH:
            return False
        return all(a.stat().st_mode & stat.S_IXOTH for a in [p, *p.parents] if a.is_dir())
    except OSError:
        return False


def other_user() -> tuple[int, int] | None:
    """(uid, gid) the submission runs as when we are root (`nobody`), else None. None too where that user
    could not even run Python (an interpreter under /root, say): landlock then does the confining."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    name = os.environ.get("TOOLKIT_GRADING_USER", NOBODY)
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    if not all(map(_open_to_others, [sys.executable, *python_paths()])):
        return None
    return entry.pw_uid, entry.pw_gid


def hand_over(paths, user) -> None:
    """Give the folders the submission writes to its user (root only)."""
    if user is None:
        return
    for path in paths:
        for root, dirs, files in os.walk(path):
            for name in [root] + [os.path.join(root, n) for n in dirs + files]:
                os.chown(name, *user, follow_symlinks=False)


def become(user) -> None:
    """Drop root for good: this process and its children are `user` from now on."""
    if user is None:
        return
    uid, gid = user
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


# --- limits ------------------------------------------------------------------------------------------------
def _data_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _own_tasks() -> int:
    """Threads and processes of this real user now (what RLIMIT_NPROC counts)."""
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return count


def _lower(kind, value: int) -> None:
    soft, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, hard))


def limit(memory_limit_mb: float | None, max_processes: int | None) -> None:
    """From now on: at most `memory_limit_mb` MiB more data, `max_processes` more threads and processes of
    this user (only effective for a user other than root), no file over FILE_SIZE_LIMIT, no core files."""
    if not sys.platform.startswith("linux"):
        return
    if memory_limit_mb:
        _lower(resource.RLIMIT_DATA, _data_bytes() + int(memory_limit_mb * 2**20))
    if max_processes and os.getuid() != 0:
        _lower(resource.RLIMIT_NPROC, _own_tasks() + max_processes)
    _lower(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT)
    _lower(resource.RLIMIT_CORE, 0)


def describe() -> str:
    """The protections this machine gives a submission, in a few words (the report prints them)."""
    parts = ["own processes", "time, memory and process limits"]
    if landlock_abi() >= 1:
        parts.append(f"filesystem sandbox (landlock ABI {landlock_abi()})")
    if other_user() is not None:
        parts.append(f"runs as {os.environ.get('TOOLKIT_GRADING_USER', NOBODY)}")
    return ", ".join(parts)


def isolated() -> bool:
    """True when a submission cannot read the instructor's files (landlock, or another user)."""
    return landlock_abi() >= 1 or other_user() is not None
