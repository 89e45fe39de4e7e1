"""The narrow channel between a submission's ranks and the grader: plain values and tensors, as JSON.

A rank that runs a student's code is untrusted, so what it sends back must not be able to do anything
but be read: no pickle (unpickling runs code), only JSON holding None, bools, numbers, strings, lists,
string-keyed dicts and tensors (dtype, shape and the raw bytes, base64). Anything else a task returns
(a student's object) crosses as `Opaque` (its type name and a short repr) so that a judge can say "got a
Foo". `decode` checks everything it reads (size, nesting, dtypes, the bytes against the shape) and raises
`WireError`, never anything a judge would mistake for an answer.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass

import torch

MAX_BYTES = 64 * 2**20  # one rank's answer to one check
MAX_DEPTH = 32
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
    )
}


class WireError(ValueError):
    """What a rank sent cannot be read as an answer."""


@dataclass(frozen=True)
class Opaque:
    """A value the channel does not carry (a student's object): its type and the start of its repr."""

    type_name: str
    text: str

    def __repr__(self) -> str:
        return f"<a {self.type_name}: {self.text}>"


def _encode(value, depth: int = 0):
    if depth > MAX_DEPTH:
        return {"__opaque__": "deeply nested value", "text": ""}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.is_complex() and t.dtype != torch.complex64 or str(t.dtype).removeprefix("torch.") not in DTYPES:
            t = t.to(torch.float64)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(raw).decode(),
        }
    if isinstance(value, (list, tuple)):
        return [_encode(v, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) and not k.startswith("__") for k in value):
        return {k: _encode(v, depth + 1) for k, v in value.items()}
    if isinstance(value, dict):
        return {"__pairs__": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    try:
        text = repr(value)[:200]
    except Exception:  # noqa: BLE001 - a student's __repr__ may raise
        text = "(its repr raised)"
    return {"__opaque__": type(value).__name__, "text": text}


def encode(value) -> bytes:
    """`value` as the bytes a rank writes (runs on the rank)."""
    return json.dumps(_encode(value), allow_nan=False).encode()


def _decode(value, depth: int):
    if depth > MAX_DEPTH:
        raise WireError("nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, depth + 1) for v in value]
    if not isinstance(value, dict):
        raise WireError(f"an unknown value {str(value)[:80]}")
    if not any(k.startswith("__") for k in value):
        return {k: _decode(v, depth + 1) for k, v in value.items()}
    if len(value) > 3:
        raise WireError(f"an unknown value {str(value)[:80]}")
    if "__tensor__" in value:
        return _tensor(value)
    if "__float__" in value and value["__float__"] in ("nan", "inf", "-inf"):
        return float(value["__float__"])
    if "__pairs__" in value and isinstance(value["__pairs__"], list):
        pairs = [_pair(p, depth) for p in value["__pairs__"]]
        try:
            return {_hashable(k): v for k, v in pairs}
        except TypeError as exc:
            raise WireError(f"a dict with a key that cannot be one: {exc}") from None
    if "__opaque__" in value and isinstance(value.get("text", ""), str):
        return Opaque(str(value["__opaque__"])[:100], value.get("text", "")[:200])
    raise WireError(f"an unknown value {str(value)[:80]}")


def _pair(pair, depth):
    if not isinstance(pair, list) or len(pair) != 2:
        raise WireError("a malformed dict entry")
    return _decode(pair[0], depth + 1), _decode(pair[1], depth + 1)


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _tensor(value) -> torch.Tensor:
    dtype, shape, data = value.get("__tensor__"), value.get("shape"), value.get("data")
    if (
        dtype not in DTYPES
        or not isinstance(shape, list)
        or not isinstance(data, str)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise WireError(f"a malformed tensor (dtype {str(dtype)[:20]!r}, shape {str(shape)[:40]})")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise WireError("a tensor whose bytes are not base64") from None
    kind = DTYPES[dtype]
    numel = math.prod(shape)
    if len(raw) != numel * torch.empty((), dtype=kind).element_size():
        raise WireError(f"a {dtype} tensor of shape {shape} with {len(raw)} bytes")
    if not numel:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).reshape(shape).clone()


def decode(raw: bytes):
    """What a rank sent, checked (runs in the grader); raises WireError when it cannot be an answer."""
    if len(raw) > MAX_BYTES:
        raise WireError(f"{len(raw)} bytes, more than the {MAX_BYTES} one answer may hold")
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"not JSON ({str(exc)[:80]})") from None
    return _decode(value, 0)
