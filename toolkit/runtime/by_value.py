"""How `fn` and its arguments travel to the ranks: by value, with the source of the code they carry.

cloudpickle copies a function defined in a notebook cell or a script's `__main__` (plain pickle refers to
functions by module and name, which a fresh process cannot import). It renames every code object it copies
`<dynamic-code>`, so a rank's traceback would read `File "<dynamic-code>", line 12` with no source. The
pickler here keeps each code object's real file name, and the launcher ships the source lines it has for
those files (IPython keeps a cell's in `linecache`; a script's is on disk); the rank registers them in its
own `linecache`, so its tracebacks, and the stacks the launcher asks for, read as they would at home.
"""

from __future__ import annotations

import io
import linecache
import types
from collections import ChainMap

import cloudpickle
from cloudpickle import cloudpickle as _cloudpickle


class _KeepingFileNames(cloudpickle.Pickler):
    """cloudpickle's pickler, except that a copied code object keeps its `co_filename`."""

    def __init__(self, file):
        self.files: set[str] = set()
        # before the base class's __init__: the C pickler reads its dispatch table there, once
        self.dispatch_table = ChainMap({types.CodeType: self._code}, cloudpickle.Pickler.dispatch_table)
        super().__init__(file)

    def _code(self, code: types.CodeType):
        rebuild, fields = _cloudpickle._code_reduce(code)
        self.files.add(code.co_filename)
        return rebuild, tuple(code.co_filename if field == "<dynamic-code>" else field for field in fields)


def _sources(files) -> dict[str, list[str]]:
    """{file name: its lines} for each file whose lines this process can read."""
    return {name: lines for name in sorted(files) if (lines := linecache.getlines(name))}


def register(sources: dict[str, list[str]]) -> None:
    """In the rank: make `linecache` (tracebacks, faulthandler's reader) know the shipped sources."""
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)  # no mtime: never re-read from disk


def dumps(fn, args: tuple) -> tuple[bytes, dict]:
    """(`fn` and `args` cloudpickled, {file: lines} of the code they carry); if something cannot travel, say
    which thing and what to do."""
    buffer = io.BytesIO()
    pickler = _KeepingFileNames(buffer)
    try:
        pickler.dump((fn, args))
        return buffer.getvalue(), _sources(pickler.files)
    except Exception as exc:  # noqa: BLE001 - pickling raises TypeError, PicklingError, AttributeError...
        code = getattr(fn, "__code__", None)
        carried = [(f"argument {i}", a) for i, a in enumerate(args)]
        if code is not None:
            cells = [c.cell_contents for c in (fn.__closure__ or ()) if _has_contents(c)]
            carried += [(f"the variable `{n}` it closes over", v) for n, v in zip(code.co_freevars, cells)]
            if getattr(fn, "__module__", None) == "__main__":  # cloudpickle copies __main__'s globals too
                carried += [(f"the global `{n}`", fn.__globals__[n]) for n in code.co_names if n in fn.__globals__]
        culprit = next(
            (f"{what}, a {type(v).__name__}" for what, v in carried if not _picklable(v)), "something it uses"
        )
        raise TypeError(
            f"launch sends the function and its args to every rank by value (cloudpickle), so all they carry must "
            f"be picklable; {getattr(fn, '__name__', 'the function')} carries {culprit}, which is not "
            f"({type(exc).__name__}: {exc}). Create such things (locks, open files, sockets, process groups, "
            f"CUDA streams) inside the function, on each rank, or pass something that pickles (a path, numbers, "
            f"tensors) instead."
        ) from exc


def _has_contents(cell) -> bool:
    try:
        _ = cell.cell_contents
        return True
    except ValueError:  # an empty cell (a name assigned later)
        return False


def _picklable(value) -> bool:
    try:
        cloudpickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False
