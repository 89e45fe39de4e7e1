"""No new channel out of a rank: a seccomp filter that refuses the system calls opening one (Linux x86_64, aarch64).

Once a rank of a point-to-point lab talks only through the grader's relay (`relay_group.py`), the filter
refuses, for every thread of the process and everything it starts: a new socket or socket pair (UDP between
ranks, which landlock does not cover; a UNIX socket; a new TCP connection to a rendezvous store), and System V
shared memory, semaphores, message queues and POSIX message queues (shared by the launch's ranks). The call
fails with EPERM; everything else is allowed. Standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

# syscall numbers: socket, socketpair, shmget, semget, msgget, mq_open; then seccomp(2) itself
_NUMBERS = {
    "x86_64": ((41, 53, 29, 64, 68, 240), 317, 0xC000003E),
    "aarch64": ((198, 199, 194, 190, 186, 180), 277, 0xC00000B7),
}
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_SET_MODE_FILTER, _TSYNC, _NO_NEW_PRIVS = 1, 1, 38


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _op(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def no_new_channels() -> bool:
    """Install the filter on every thread of this process; False (nothing changed) where it cannot be."""
    numbers = _NUMBERS.get(platform.machine())
    if numbers is None:
        return False
    refused, seccomp, arch = numbers
    deny = _ERRNO | errno.EPERM
    program = [
        _op(_LD_W_ABS, 0, 0, 4),  # the architecture
        _op(_JEQ_K, 1, 0, arch),
        _op(_RET_K, 0, 0, deny),
        _op(_LD_W_ABS, 0, 0, 0),
    ]  # the system call's number
    if platform.machine() == "x86_64":  # the x32 numbers (bit 30) would pass a plain check
        program.append(_op(_JGE_K, len(refused) + 1, 0, 0x40000000))
    for position, number in enumerate(refused):
        program.append(_op(_JEQ_K, len(refused) - position, 0, number))
    program += [_op(_RET_K, 0, 0, _ALLOW), _op(_RET_K, 0, 0, deny)]
    code = b"".join(program)
    buffer = ctypes.create_string_buffer(code, len(code))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    prog = _Program(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    return libc.syscall(seccomp, _SET_MODE_FILTER, _TSYNC, ctypes.byref(prog)) == 0
