"""How a process ended, in words, and how to learn it for a process that is not our child.

Standard library only: the keeper and the witness (run by path, without torch) use it too.

A parent learns its child's exit status from `waitpid`. Under mpiexec or srun a rank's parent is the
launcher's proxy, so a peer or a witness on the same machine holds a *pidfd* instead (`os.pidfd_open`,
Linux 5.3): it becomes readable when the process ends, and since Linux 6.15 `ioctl(PIDFD_GET_INFO)` with
`PIDFD_INFO_EXIT` returns the exit status once the process has been reaped, whoever reaped it. Before
that (a zombie), `/proc/<pid>/stat` still holds it; on older kernels, once reaped, the status is lost.
"""

from __future__ import annotations

import os
import select
import signal
import struct

_PIDFD_INFO_SIZE = 64  # struct pidfd_info, version 0
PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(PIDFS_IOCTL_MAGIC, 11, ...)
PIDFD_INFO_EXIT = 1 << 3
_EXIT_CODE_AT = 8 + 8 + 11 * 4  # after mask, cgroupid and 11 ids


def story(code: int) -> str:
    """What an exit code says, for a rank that ended without raising (negative: the signal that killed it)."""
    if code < 0:
        name = signal_name(-code)
        why = {
            "SIGKILL": "the kernel's out-of-memory killer does this when memory runs out; so does `kill -9`",
            "SIGSEGV": "a crash in native code (segmentation fault)",
            "SIGABRT": "a failed check in native code aborted the process",
            "SIGTERM": "something asked it to stop",
        }.get(name, "")
        return f"died: killed by {name} ({-code}){': ' + why if why else ''}"
    return (
        f"died with exit code {code} before returning (os._exit, or a crash in native code); it raised no Python error"
    )


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def watch(pid: int) -> int | None:
    """A pidfd for `pid` (None if it is gone already, or pidfds are not available)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def has_ended(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


def status(pidfd: int, pid: int, patience_s: float = 0.5) -> int | None:
    """The exit code of an ended process (negative for a signal, as `Popen.returncode`), or None if unknown."""
    import fcntl
    import time

    give_up = time.monotonic() + patience_s
    while True:
        try:
            info = bytearray(_PIDFD_INFO_SIZE)
            struct.pack_into("<Q", info, 0, PIDFD_INFO_EXIT)
            fcntl.ioctl(pidfd, PIDFD_GET_INFO, info)
            if struct.unpack_from("<Q", info, 0)[0] & PIDFD_INFO_EXIT:
                return os.waitstatus_to_exitcode(struct.unpack_from("<i", info, _EXIT_CODE_AT)[0])
        except OSError:  # a kernel before 6.15 (no such ioctl, or no exit information in it)
            pass
        try:  # not reaped yet: a zombie keeps its status in field 52 of /proc/<pid>/stat
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if fields[0] == b"Z":
                return os.waitstatus_to_exitcode(int(fields[49]))
        except (OSError, IndexError, ValueError):
            pass
        if time.monotonic() > give_up:
            return None
        time.sleep(0.005)  # between the zombie and the reaped state, or reaped on an older kernel
