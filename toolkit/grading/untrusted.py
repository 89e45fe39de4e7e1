"""What the grader takes from a submission's side, made safe to take: files and text.

Files. Everything the grader reads from a submission or from a folder its ranks could write (their results,
the launch's log, a student's file, a class folder's entries) is opened by `read`: without following a link
(O_NOFOLLOW: a planted link to `solution.py`, a FIFO or /dev/zero is refused, not followed), without blocking
(O_NONBLOCK: a FIFO planted in place of a file cannot hold the open), only if it is a regular file (fstat),
and never more than a cap (a file that grows while it is read stops at the cap). A link is refused with
`Refused`, whose message says what to do.

Text. What a rank says (an exception's text, what it printed) reaches a person through a report, a terminal or
a platform's page; `clean` makes it unable to change how the report around it looks: ANSI escapes and every
other control character (but the newline), Unicode line and paragraph separators (U+2028, U+2029) and format
characters (bidirectional overrides, zero-width joiners) are shown as escapes (`\\x1b`, `\\u2028`), so a
message can neither hide the real "Score:" line nor draw a false one.
"""

from __future__ import annotations

import os
import re
import stat
import unicodedata

TEXT_LIMIT = 4 * 2**20  # a student's file, a report's text: far more than any honest one holds
_UNSAFE = re.compile(r"[^\n\x20-\x7e]")  # a fast path: plain printable ASCII needs no look-up


class Refused(OSError):
    """A file the grader will not read: a link, a FIFO, a device, a folder, or too big."""


def read(path, limit: int = TEXT_LIMIT, *, what: str = "file") -> bytes:
    """The bytes of the regular file `path` (not a link to one), at most `limit` of them, or Refused/OSError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise Refused(
                f"{what} {path} is a link (to {os.readlink(path)}): the grader reads only regular files, "
                "never through a link; copy the file itself there"
            ) from None
        raise exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Refused(
                f"{what} {path} is not a regular file (a folder, a FIFO or a device): the grader reads "
                "only regular files"
            )
        if info.st_size > limit:
            raise Refused(f"{what} {path} holds {info.st_size} bytes, more than the {limit} the grader reads")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Refused(f"{what} {path} grew past the {limit} bytes the grader reads")
        return b"".join(chunks)
    finally:
        os.close(fd)


def tail(path, limit: int) -> bytes:
    """The last `limit` bytes of the regular file `path` (a log that may have grown without end); b"" if it
    cannot be read that way."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return b""
        os.lseek(fd, max(0, info.st_size - limit), os.SEEK_SET)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def is_file(path) -> bool:
    """`path` is a regular file itself (a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _shown(char: str) -> str:
    if char == "\t":
        return "    "
    if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
        code = ord(char)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    return char


def clean(text) -> str:
    """`text` with every character that could change the look of what surrounds it shown as an escape (a tab as
    spaces); lines stay lines ("\\r\\n" becomes "\\n"; a lone "\\r", which would return to the line's start, is
    shown)."""
    text = str(text).replace("\r\n", "\n")
    if not _UNSAFE.search(text):
        return text
    return "".join(_shown(c) if c != "\n" else c for c in text)
