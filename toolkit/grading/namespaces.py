"""What a submission's processes cannot see, by construction: namespaces of their own (Linux).

Before anything of a launch runs, the process that will become its sandbox (`sandbox.enter`) calls `enter`:

1. A **PID namespace** (unshare CLONE_NEWPID; as a user other than root, inside a user namespace of its own
   first): the process forks the namespace's first process and waits for it. Every process of the launch
   lives in the namespace, and the /proc they see is the namespace's own: the grader, the shell that started
   it and every other process of the machine are not there to read (`environ`, `cmdline`) or signal. When
   the first process ends, the kernel ends every process in the namespace: nothing of the launch survives it.
2. A **mount namespace** (CLONE_NEWNS, every mount private): a fresh /proc; a fresh, small tmpfs on /dev/shm,
   /tmp and /var/tmp (the launch's own: nothing written there reaches another grading, and it is gone with the
   launch; the grading's folder stays reachable where it lies inside /tmp); an IPC namespace too (System V
   shared memory and semaphores, the other channel between gradings); and a **network namespace** with only a
   loopback (the ranks talk over it; the machine's own, where another grading's store or any local service
   listens, and the internet, are out of reach).
3. **Reachable by the sandbox's user** (`nobody` when grading as root): where a folder the submission must read
   (the interpreter, its libraries) lies below one that user may not enter (a Python under /root), that
   folder is covered with an empty tmpfs that holds only the paths needed, bound from where they are: the
   interpreter is reachable and nothing else of /root is.

Where the kernel refuses (no user namespaces, a container without the capability to mount), `probe` says so
before any grading and `sandbox.describe` reports the protections that remain; grading as root where the
sandbox's user cannot reach the interpreter and no namespace can make it reachable is refused
(`sandbox.preflight`): never silently as root. Standard library only: the graders' fork server loads it by path.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import subprocess
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x08000000, 0x10000000, 0x20000000
CLONE_NEWNET, SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x40000000, 0x8913, 0x8914, 0x1
LOOPBACK_ONLY = "its own network (a loopback only)"
OWN_PIDS = "its own PID namespace"  # made: no process of the launch sees or signals one outside it
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
SHARED_TMP = ("/dev/shm", "/tmp", "/var/tmp")
TMPFS_SIZE = "size=64m"  # what a launch may keep in its /tmp and /dev/shm (its folder, where it writes, is apart)
_PR_SET_PDEATHSIG = 1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    _call(
        _libc().mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {target}",
    )


def _own_user_namespace() -> None:
    """As a user other than root: a user namespace where this process keeps its uid and gains the right to
    make the other namespaces (and to mount in them). Must run while single-threaded."""
    uid, gid = os.geteuid(), os.getegid()
    _call(_libc().unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _blocks(folder: str, uid: int, gid: int) -> bool:
    """`uid` may not pass through `folder` (it is not the owner, not in its group, and others may not enter)."""
    info = os.stat(folder)
    if info.st_uid == uid:
        return not info.st_mode & stat.S_IXUSR
    if info.st_gid == gid:
        return not info.st_mode & stat.S_IXGRP
    return not info.st_mode & stat.S_IXOTH


def blocked(paths, user) -> dict[str, list[str]]:
    """{the highest folder `user` (uid, gid) may not enter: the paths below it it must read}, for `paths`."""
    found: dict[str, list[str]] = {}
    if user is None:
        return found
    for path in sorted({os.path.realpath(p) for p in paths if os.path.exists(p)}):
        folders = [path] if os.path.isdir(path) else []
        parent = os.path.dirname(path)
        while True:
            folders.append(parent)
            if parent == "/":
                break
            parent = os.path.dirname(parent)
        barrier = next((f for f in reversed(folders) if f != path and _blocks(f, *user)), None)
        if barrier is not None:
            found.setdefault(barrier, []).append(path)
    return found


def _cover(folder: str, keep: list[str], mode: int = 0o755) -> None:
    """Mount an empty tmpfs on `folder`, holding only the paths `keep` (below it), bound from where they were."""
    kept = [p for p in sorted(set(keep)) if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in keep)]
    handles = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in kept}  # what they are, before the cover hides them
    try:
        mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, f"{TMPFS_SIZE},mode={mode:o}")
        for path, handle in handles.items():
            if os.path.isdir(f"/proc/self/fd/{handle}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "a").close()
            for below in _between(folder, path):
                os.chmod(below, 0o755)
            mount(f"/proc/self/fd/{handle}", path, None, MS_BIND | MS_REC)
    finally:
        for handle in handles.values():
            os.close(handle)


def kept(box: str, prefix: str, exec_prefix: str, path: list[str]) -> list[str]:
    """What a covered /tmp keeps: the grading's box, and the Python environment the ranks run in (a clone under
    /tmp: its .venv's packages, which no rank has imported yet, would vanish with the machine's /tmp): its
    prefixes and every package folder on `path` (a .pth may name another environment's), by the name the ranks
    use and where it resolves. Not the rest of `path`: the working folder may be the instructor's."""
    packages = [p for p in path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    named = [prefix, exec_prefix, *packages]
    return [os.path.realpath(box)] + [q for p in named for q in (os.path.abspath(p), os.path.realpath(p))]


def _between(top: str, path: str) -> list[str]:
    """The folders from `top` (excluded) down to `path`'s parent: the ones made inside a cover."""
    found, parent = [], os.path.dirname(path)
    while parent.startswith(top.rstrip("/") + "/"):
        found.append(parent)
        parent = os.path.dirname(parent)
    return found


def _die_with_parent(alive: int) -> None:
    """Killed when the parent ends. The parent is outside this PID namespace (getppid() says 0), so whether it
    ended before the prctl is told by `alive`, a pipe whose writing end only the parent holds: EOF, it is gone."""
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.set_blocking(alive, False)
    try:
        if os.read(alive, 1) == b"":
            os._exit(1)
    except BlockingIOError:
        pass
    os.close(alive)


def _wait_for(child: int) -> None:
    """In the process that made the PID namespace: wait for its first process, then end as it ended. A SIGTERM
    (the grader stopping the launch) ends the namespace at once: its first process dies with this one."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(1)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def enter(box: str, user, reach: list[str]) -> list[str]:
    """Namespaces for what this process runs next (see the module's docstring); returns what was made, [] where
    the kernel allows none. `box`: the grading's folder (kept reachable); `user`: (uid, gid) the sandbox becomes,
    or None; `reach`: what that user must read. Returns in the namespaces' first process (the caller's child;
    the caller waits for it and never returns), or in the caller itself where no PID namespace could be made.
    Call while single-threaded."""
    made = []
    try:
        if os.geteuid() != 0:
            _own_user_namespace()
        _call(_libc().unshare(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC), "unshare(CLONE_NEWPID|CLONE_NEWNS)")
    except OSError:
        return made
    alive, holding = os.pipe()
    child = os.fork()
    if child:
        os.close(alive)
        _wait_for(child)
    os.close(holding)
    _die_with_parent(alive)
    made.append(OWN_PIDS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        made.append("its own /proc")
    except OSError:
        pass  # a container's /proc with parts masked: the kernel refuses another; the grader's process is apart
    keep = kept(box, sys.prefix, sys.exec_prefix, sys.path)
    for folder in SHARED_TMP:
        if os.path.isdir(folder) and not os.path.islink(folder):
            _cover(folder, [p for p in keep if p.startswith(folder + "/")], 0o1777)
    made.append("private /tmp and /dev/shm")
    try:
        _own_network()
        made.append(LOOPBACK_ONLY)
    except OSError:
        pass  # the machine's network stays reachable (the launch's ranks still talk over its loopback)
    for barrier, paths in blocked(reach, user).items():
        _cover(barrier, paths)
        made.append(f"{barrier} covered but for {', '.join(paths)}")
    return made


def _own_network() -> None:
    """A network namespace of the launch's own with its loopback up: the ranks reach each other (gloo, their store,
    on 127.0.0.1), and nothing of the machine's (another grading's store, a local service, the internet)."""
    import fcntl
    import socket
    import struct

    _call(_libc().unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)  # struct ifreq: the name, then its flags
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's device: the only interface there is


def drop_capabilities() -> None:
    """No capability left in this process (the ones a user namespace gave it), for good."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _call(_libc().capset(ctypes.byref(Header(0x20080522, 0)), ctypes.byref((Data * 2)())), "capset")


_PROBE = f"""
import json, os, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import namespaces
try:
    made = namespaces.enter(sys.argv[1], None, [])
except OSError as exc:
    made = ["failed: " + str(exc)]
print(json.dumps(made), flush=True)
"""
_probed: list = []


def probe() -> list[str]:
    """What `enter` makes on this machine (tried in a short-lived interpreter, once per process)."""
    if not _probed:
        if not sys.platform.startswith("linux"):
            _probed.append([])
        else:
            try:
                done = subprocess.run(
                    [sys.executable, "-S", "-c", _PROBE, "/"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    stdin=subprocess.DEVNULL,
                )
                made = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else []
            except (OSError, ValueError, subprocess.TimeoutExpired):
                made = []
            _probed.append([m for m in made if not m.startswith("failed")])
    return _probed[0]
