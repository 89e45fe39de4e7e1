"""A grading's writable folders on volumes of their own: what a submission writes is capped in all, not per file.

The kernel caps each file a launch writes (RLIMIT_FSIZE, `sandbox.FILE_SIZE_LIMIT`), but a submission that writes
many files under that cap could still fill the machine's disk. So the folders a grading's ranks write lie on
tmpfs volumes of `Limits.disk_limit_mb` MiB and at most MAX_FILES files each (a file costs the kernel memory of
its own, bytes or none): one for what the submission writes (work/, tmp/), one for what its ranks send back
(inputs/, out/), so that a full working folder still lets every check say why it failed. They are mounted in a
mount namespace the grading holds for its whole life:

1. `Volume(root, volumes, size_mb)` (in the grader) starts a holder: a small interpreter of the standard library
   that makes a user namespace (the grader maps its ids into it from outside: as root every id to itself, so
   that the sandbox's `nobody` is one there too; else its own) and a mount namespace in it, mounts each tmpfs on
   `root`/volumes/<name> and binds a folder of it over each writable folder of the same name. It then waits for
   the grader to let it go (the end of its stdin); the namespace, and every byte written there, go with the last
   process in it.
2. Every launch's first process joins that namespace before anything else (`join`, from `sandbox.enter`; a
   launcher started as a fresh interpreter, through `entering`): the spec's paths are the same, and lead to the
   volumes. A write past a cap fails in the submission's own code
   (ENOSPC: `full` recognises it, and the check's message names the limit).
3. The grader reads and writes those folders through the holder's root (`Volume.seen`: /proc/<pid>/root/...).

Nothing the submission can touch decides a cap: the holder is outside the launch's PID namespace, the size is
set when the tmpfs is mounted, and only a process with CAP_SYS_ADMIN in the holder's user namespace could mount it
again (the launch's processes hold none once they become the sandbox's user). Without a user namespace, a grader
with CAP_SYS_ADMIN makes the mount namespace alone. Where the machine allows neither, `Volume` raises
`Unavailable`; the grading keeps the per-file cap and its report says so (`box.Box.disk`).

Standard library only: the graders' fork server loads it by path (through `sandbox.py`), and the holder too.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import subprocess
import sys

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MAX_FILES = 65_536  # files and folders on one grading's volume
FOLDER = "volumes"  # where each tmpfs is mounted in the grading's folder (then bound over its folders)
START_S = 60.0
HOLDER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import namespaces, volume
volume.hold(json.loads(sys.argv[2]), namespaces)
"""


class Unavailable(OSError):
    """This machine gives a grading no volume of its own (no user namespace, no CAP_SYS_ADMIN): why."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return _libc().unshare(flags) == 0


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def hold(request: dict, namespaces) -> None:
    """The holder (`HOLDER`): namespaces, the tmpfs and its binds, then wait for the grader. Never returns."""
    own = _unshare(CLONE_NEWUSER)
    _say({"user": own})
    if sys.stdin.readline().strip() != "go":  # once the grader mapped our ids (from outside), if `own`
        os._exit(1)
    if not _unshare(CLONE_NEWNS):
        _say({"error": f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"})
        os._exit(1)
    root = request["root"]
    try:
        namespaces.mount(None, "/", None, namespaces.MS_REC | namespaces.MS_PRIVATE)
        for name, folders in request["volumes"].items():
            top = os.path.join(root, FOLDER, name)
            options = f"size={int(request['size_kb'])}k,nr_inodes={MAX_FILES},mode=0755"
            namespaces.mount("tmpfs", top, "tmpfs", namespaces.MS_NOSUID | namespaces.MS_NODEV, options)
            for folder in folders:
                os.mkdir(os.path.join(top, folder), 0o755)
                namespaces.mount(os.path.join(top, folder), os.path.join(root, folder), None, namespaces.MS_BIND)
    except OSError as exc:
        _say({"error": str(exc)})
        os._exit(1)
    _say({"ready": True})
    sys.stdin.read()  # until the grader lets go
    os._exit(0)


class Volume:
    """Each group of folders of `root` ({name: [folder, ...]}) on a tmpfs of its own of `size_mb` MiB, held by a
    process of the grader's: `seen(path)` is where the grader finds a path inside them; `pid`, the process whose
    namespace a launch joins (`join`); `close()` lets them go."""

    def __init__(self, root: str, volumes: dict, size_mb: float):
        self.root, self.size_mb = os.path.realpath(root), size_mb
        for name in volumes:
            os.makedirs(os.path.join(self.root, FOLDER, name), mode=0o700)
        request = {"root": self.root, "volumes": volumes, "size_kb": max(1, int(size_mb * 1024))}
        self._holder = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", HOLDER, os.path.dirname(os.path.abspath(__file__)), json.dumps(request)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},  # nothing of the grader's, no grading's id
        )
        self.pid = self._holder.pid
        try:  # one word at a time, each answered: never two lines in flight
            if self._told().get("user"):
                _map_ids(self.pid)
            self._holder.stdin.write("go\n")
            self._holder.stdin.flush()
            told = self._told()
        except (OSError, ValueError) as exc:
            told = {"error": str(exc)}
        if not told.get("ready"):
            self.close()
            raise Unavailable(errno.EPERM, told.get("error") or "the volume's holder ended")

    def _told(self) -> dict:
        """The holder's next word (it says each step at once, or ends)."""
        if not select.select([self._holder.stdout], [], [], START_S)[0]:
            return {"error": f"the volume's holder said nothing in {START_S:.0f} s"}
        line = self._holder.stdout.readline()
        return json.loads(line) if line.strip() else {"error": self._holder.stderr.read()[-500:].strip()}

    def seen(self, path) -> str:
        """Where the grader reads and writes `path` (inside the grading's folder) as the launches see it."""
        return f"/proc/{self.pid}/root{os.path.realpath(path)}"

    def close(self) -> None:
        """Let the holder go: the tmpfs goes with the last process in its namespace."""
        try:
            self._holder.stdin.close()
        except OSError:
            pass
        try:
            self._holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._holder.kill()
            self._holder.wait()
        for stream in (self._holder.stdout, self._holder.stderr):
            stream.close()


def _map_ids(pid: int) -> None:
    """From outside: the holder's user namespace maps every id to itself (as root, so that the sandbox's user
    exists there too) or this user's own."""
    if os.geteuid() == 0:
        maps = {"uid_map": "0 0 4294967295", "gid_map": "0 0 4294967295"}
    else:
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        maps = {"uid_map": f"{os.geteuid()} {os.geteuid()} 1", "gid_map": f"{os.getegid()} {os.getegid()} 1"}
    for name, text in maps.items():
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


def join(pid: int) -> None:
    """This process (single-threaded, before anything of the launch runs) enters the namespace of the volume's
    holder `pid`, unless it is there already (`entering`); its working folder is found again there."""
    if _namespace("self", "mnt") == _namespace(pid, "mnt"):
        return
    here = os.getcwd()
    kinds = ([CLONE_NEWUSER] if _namespace("self", "user") != _namespace(pid, "user") else []) + [CLONE_NEWNS]
    handles = [os.open(f"/proc/{pid}/ns/{'user' if kind == CLONE_NEWUSER else 'mnt'}", os.O_RDONLY) for kind in kinds]
    try:
        for handle, kind in zip(handles, kinds):
            if _libc().setns(handle, kind) != 0:
                number = ctypes.get_errno()
                raise OSError(number, f"setns into the grading's volume: {os.strerror(number)}")
    finally:
        for handle in handles:
            os.close(handle)
    os.chdir(here)


def _namespace(pid, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def entering(pid: int, command: list[str]) -> list[str]:
    """`command` started inside the namespace of the volume's holder `pid`: an interpreter that imports torch has
    threads by the time it could join (setns wants one), so a small one joins first, then becomes `command`."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(pid), *command]


def full(exc: BaseException) -> bool:
    """The error a write past the volume's cap raises (in the submission's code)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


if __name__ == "__main__":  # `entering`: join, then become the command
    join(int(sys.argv[1]))
    os.execv(sys.argv[2], sys.argv[2:])
