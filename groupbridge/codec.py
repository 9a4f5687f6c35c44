"""A safe encoding for objects exchanged through a group's store.

Only plain data crosses the wire: None, bool, int, float, str, bytes, list, tuple, dict with str keys, and
torch tensors (dtype, shape and bytes; always decoded onto the CPU). Decoding never runs code, so whoever can
write to the store cannot execute anything in a member. Pickle is available only when both the encoding and
the decoding side opted in (``allow_pickle=True``).

The format is MessagePack (the ``msgpack`` package: a C decoder built for untrusted input, which checks
every length against the bytes present before allocating) with four extension types: tuple, tensor, an
integer beyond 64 bits, and (opt-in) pickle. It replaced a home-made format that decoded a small dict
7x slower and needed its own bounds checks.
"""

from __future__ import annotations

import pickle
import re
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import torch

from .errors import ProtocolError

__all__ = ["MAX_DEPTH", "decode", "encode"]

MAX_DEPTH = 64
"""Tuples nest through extension types, each decoded on its own: this bounds how deep (lists and dicts are
bounded by the decoder's own stack)."""
MAX_DIMS = 32
MAX_INT_DIGITS = 4300  # Python's own limit on int() of a str
_INT = re.compile(rb"-?[0-9]+")
_MAGIC = b"GB2"
_TUPLE, _TENSOR, _BIGINT, _PICKLE = 1, 2, 3, 4
_TENSOR_HEAD = struct.Struct("<H")
_PACK_DEPTH = 500  # below msgpack's own limit (511), so a cycle is a TypeError, not a RecursionError

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        *(
            getattr(torch, n)
            for n in (
                "float8_e4m3fn",
                "float8_e5m2",
                "float8_e4m3fnuz",
                "float8_e5m2fnuz",
                "uint16",
                "uint32",
                "uint64",
            )
            if hasattr(torch, n)
        ),
    )
}


_NAMES: dict[torch.dtype, str] = {d: n for n, d in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name on the wire (looked up: a sync names every tensor's dtype)."""
    name = _NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype {name!r} on the wire") from None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor in C order (copied to the CPU)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def tensor_from_bytes(data: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor from its raw bytes; the byte count is checked against the shape before allocating."""
    numel = 1
    for size in shape:
        numel *= size
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ProtocolError(f"tensor of {dtype} {list(shape)} needs {expected} bytes, got {len(data)}")
    out = torch.empty(shape, dtype=dtype)
    if numel:
        out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return out


def _default(obj: Any, allow_pickle: bool) -> Any:
    kind = type(obj)
    if kind is tuple:
        return msgpack.ExtType(_TUPLE, _pack(list(obj), allow_pickle))
    if kind is int:  # beyond 64 bits (msgpack asks only then)
        return msgpack.ExtType(_BIGINT, str(obj).encode())
    if kind in (bytearray, memoryview):
        return bytes(obj)
    if isinstance(obj, torch.Tensor) and kind in (torch.Tensor, torch.nn.Parameter):
        name = dtype_name(obj.dtype)
        if name not in _DTYPES:
            raise TypeError(f"tensors of dtype {obj.dtype} cannot travel in the safe encoding")
        head = msgpack.packb([name, list(obj.shape)])
        return msgpack.ExtType(_TENSOR, _TENSOR_HEAD.pack(len(head)) + head + tensor_bytes(obj))
    if allow_pickle:
        return msgpack.ExtType(_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    raise TypeError(
        f"{kind.__name__} cannot travel in the safe encoding (None, bool, int, float, str, bytes, "
        "list, tuple, dict with str keys, tensors); convert it, or make the group with allow_pickle=True"
    )


def _default_safe(obj: Any) -> Any:
    return _default(obj, False)


def _default_pickle(obj: Any) -> Any:
    return _default(obj, True)


def _packer(allow_pickle: bool) -> msgpack.Packer:
    return msgpack.Packer(
        default=_default_pickle if allow_pickle else _default_safe,
        strict_types=True,
        use_bin_type=True,
        datetime=False,
    )


_idle: tuple[list[msgpack.Packer], list[msgpack.Packer]] = ([], [])
"""Idle packers of each kind (safe, pickle-allowed), kept between calls: building a packer costs as much as
packing a small object, more so with cold caches. A packer in use is taken out (``list.pop`` and
``append`` are atomic), so another thread, or a call made while it packs (a tuple's items, packed from
inside its ``default``; a ``__reduce__`` or a signal handler that encodes), takes another or makes a fresh
one. One that raised or packed more than ``_KEEP_MAX`` (its buffer grows to the largest object and stays
so) is not put back, nor more than ``_IDLE_MAX`` of a kind."""
_IDLE_MAX = 4
_KEEP_MAX = 256 << 10


def _check_keys(obj: Any, depth: int = 0) -> None:
    """msgpack takes any dict key; the safe set takes str keys only (and says so on the sending side)."""
    if depth > _PACK_DEPTH:
        raise TypeError(f"object nests deeper than {_PACK_DEPTH} levels")
    if type(obj) is dict:
        for key, value in obj.items():
            if type(key) is not str:
                raise TypeError(f"dict keys must be str to travel safely, got {type(key).__name__} {key!r}")
            if type(value) in (dict, list):
                _check_keys(value, depth + 1)
    elif type(obj) is list:
        for value in obj:
            if type(value) in (dict, list):
                _check_keys(value, depth + 1)


def _pack(obj: Any, allow_pickle: bool) -> bytes:
    _check_keys(obj)
    idle = _idle[1 if allow_pickle else 0]
    try:
        packer = idle.pop()
    except IndexError:
        packer = _packer(allow_pickle)
    try:
        out = packer.pack(obj)
    except ValueError as e:  # msgpack's own nesting limit
        raise TypeError(f"object cannot be encoded: {e}") from None
    except RecursionError:
        raise TypeError("object nests too deeply to be encoded") from None
    if len(out) <= _KEEP_MAX and len(idle) < _IDLE_MAX:
        idle.append(packer)
    return out  # type: ignore[no-any-return]  # bytes: the packer resets after each call


def encode(obj: Any, *, allow_pickle: bool = False) -> bytes:
    """Encode ``obj``; raises ``TypeError`` for anything outside the safe set unless pickle is allowed."""
    return _MAGIC + _pack(obj, allow_pickle)


def _pairs(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("a dict key appears twice")
    for key in out:
        if type(key) is not str:
            raise ProtocolError("dict key on the wire is not a str")
    return out


def _tensor(data: bytes) -> torch.Tensor:
    if len(data) < _TENSOR_HEAD.size:
        raise ProtocolError("truncated tensor")
    (n,) = _TENSOR_HEAD.unpack_from(data)
    head = msgpack.unpackb(data[_TENSOR_HEAD.size : _TENSOR_HEAD.size + n])
    if not (
        isinstance(head, list) and len(head) == 2 and isinstance(head[0], str) and isinstance(head[1], list)
    ):
        raise ProtocolError("malformed tensor header")
    name, shape = head
    if len(shape) > MAX_DIMS or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"malformed tensor shape {shape[: MAX_DIMS + 1]!r}")
    return tensor_from_bytes(memoryview(data)[_TENSOR_HEAD.size + n :], dtype_from_name(name), tuple(shape))


def _ext_hook(allow_pickle: bool, depth: int) -> Callable[[int, bytes], Any]:
    """msgpack's hook for the extension types, inside ``depth`` tuples."""

    def ext(code: int, payload: bytes) -> Any:
        if code == _TUPLE:
            if depth >= MAX_DEPTH:
                raise ProtocolError(f"message nests deeper than {MAX_DEPTH} tuples")
            items = _unpack(payload, allow_pickle, depth + 1)
            if type(items) is not list:
                raise ProtocolError("malformed tuple")
            return tuple(items)
        if code == _TENSOR:
            return _tensor(payload)
        if code == _BIGINT:
            if not 0 < len(payload) <= MAX_INT_DIGITS or not _INT.fullmatch(payload):
                raise ProtocolError("malformed integer")
            return int(payload)
        if code == _PICKLE:
            if not allow_pickle:
                raise ProtocolError(
                    "a peer sent a pickled object but this group does not allow pickle (allow_pickle=False)"
                )
            return pickle.loads(payload)
        raise ProtocolError(f"unknown extension type {code} in message")

    return ext


_TOP_HOOKS = (_ext_hook(False, 0), _ext_hook(True, 0))
"""The hooks of a message's top level (safe, pickle-allowed), made once: a decode builds no closure."""


_UNPACK: dict[str, Any] = {"object_pairs_hook": _pairs, "strict_map_key": False, "raw": False, "timestamp": 2}
"""The decoder's options besides the extension hook (timestamp=2: msgpack's own timestamp extension decodes to
a plain int, nanoseconds)."""


def _unpack(data: bytes, allow_pickle: bool, depth: int) -> Any:
    """A tuple's items (``depth`` tuples down)."""
    return msgpack.unpackb(data, ext_hook=_ext_hook(allow_pickle, depth), **_UNPACK)


def decode(data: bytes, *, allow_pickle: bool = False) -> Any:
    """Decode what :func:`encode` produced; never runs code unless ``allow_pickle``.

    The input is treated as hostile: every length is checked against the bytes present before anything is
    allocated, and anything malformed raises :class:`ProtocolError` (never a decoding, index or memory
    error).
    """
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"message is a {type(data).__name__}, not bytes")
    if not data.startswith(_MAGIC):
        raise ProtocolError("message does not start with the groupbridge codec header")
    try:
        return msgpack.unpackb(
            memoryview(data)[len(_MAGIC) :], ext_hook=_TOP_HOOKS[1 if allow_pickle else 0], **_UNPACK
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as e:
        raise ProtocolError(f"malformed message: {type(e).__name__}: {e}") from None
