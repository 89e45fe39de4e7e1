"""Landlock (Linux 5.13+, no privileges needed): from now on this process and its children may read only these
folders and write only those; everything else of the filesystem is out of reach, and so are ptrace and (ABI 6+)
signals and abstract sockets to any process outside.

A rule grants a folder and everything below it; there is no rule that takes something back. To let a
submission read a tree *but* a part of it (the system's Python, but not a full toolkit installed in its
site-packages; /opt, but not a course's checkout there), `restrict` grants each such tree entry by entry down
to the hidden part, leaving it out (`_allow_tree`). Standard library only: the graders' fork server loads it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

# syscall numbers (the same on every architecture), rights, rule type
_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446
_PATH_BENEATH, _NO_NEW_PRIVS = 1, 38
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_ALL_V1 = (1 << 13) - 1  # execute .. make_sym
_FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | (1 << 14) | (1 << 15)  # + truncate, ioctl_dev
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2
_BIND_TCP, _CONNECT_TCP = 1, 2
READ = EXECUTE | READ_FILE | READ_DIR


class _Ruleset(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's landlock ABI version, 0 where there is none (not Linux, too old, or disabled)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64", "riscv64"):
        return 0
    try:
        version = _libc().syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(0, int(version))


def _rights(version: int) -> int:
    return (
        _ALL_V1 | (1 << 13 if version >= 2 else 0) | (1 << 14 if version >= 3 else 0) | (1 << 15 if version >= 5 else 0)
    )


def restrict(
    read: list, write: list, listable: list = (), hidden: list = (), version: int | None = None, no_tcp: bool = False
) -> bool:
    """From now on this process and its children may only read `read` (but what lies in `hidden`), read-write
    `write`, and list the folders `listable` (their names, not their files' content); with `no_tcp` (ABI 4+),
    neither bind nor connect a TCP socket. Returns False (and changes nothing) where the kernel has no landlock."""
    version = abi() if version is None else version
    if version < 1:
        return False
    libc, handled = _libc(), _rights(version)
    size = 8 if version < 4 else 16 if version < 6 else 24
    ruleset = _Ruleset(
        handled,
        _BIND_TCP | _CONNECT_TCP if no_tcp and version >= 4 else 0,
        (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if version >= 6 else 0,
    )
    fd = libc.syscall(_CREATE, ctypes.byref(ruleset), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return False
    hidden = sorted({os.path.realpath(h) for h in hidden})
    try:
        for path in listable:
            _allow(libc, fd, path, READ_DIR & handled)
        for path in read:
            _allow_tree(libc, fd, os.path.realpath(path), READ & handled, hidden)
        for path in write:
            _allow(libc, fd, path, handled)
        if libc.prctl(_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_RESTRICT, fd, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)
    return True


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _allow_tree(libc, ruleset_fd: int, path: str, allowed: int, hidden: list, seen: set | None = None) -> None:
    """`allowed` on `path` and below, but on nothing of `hidden`: where a hidden path lies below, the folder is
    only listed, and each of its entries is granted the same way."""
    seen = set() if seen is None else seen
    if path in seen or any(_inside(path, h) for h in hidden):
        return
    seen.add(path)
    if not any(_inside(h, path) for h in hidden) or not os.path.isdir(path):
        _allow(libc, ruleset_fd, path, allowed)
        return
    _allow(libc, ruleset_fd, path, allowed & READ_DIR)
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return
    for name in entries:
        _allow_tree(libc, ruleset_fd, os.path.realpath(os.path.join(path, name)), allowed, hidden, seen)


def _allow(libc, ruleset_fd: int, path, allowed: int) -> None:
    try:
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # not on this machine: nothing to allow
    try:
        if not os.path.isdir(path):
            allowed &= _FILE_ONLY
        rule = _PathBeneath(allowed, target)
        if (
            libc.syscall(_ADD_RULE, ruleset_fd, ctypes.c_int(_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0))
            != 0
        ):
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
    finally:
        os.close(target)
