"""A safe encoding for objects exchanged through a group's store.

Only plain data crosses the wire: None, bool, int, float, str, bytes, list, tuple, dict with str keys, and
torch tensors (dtype, shape and bytes; always decoded onto the CPU). Decoding never runs code, so whoever can
write to the store cannot execute anything in a member. Pickle is available only when both the encoding and
the decoding side opted in (``allow_pickle=True``).
"""

from __future__ import annotations

import pickle
import re
import struct
from typing import Any

import torch

from .errors import ProtocolError

__all__ = ["MAX_DEPTH", "decode", "encode"]

MAX_DEPTH = 64
MAX_DIMS = 32
MAX_INT_DIGITS = 4300  # Python's own limit on int() of a str
_INT = re.compile(rb"-?[0-9]+")
_MAGIC = b"GB1"

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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def _pack_len(buf: bytearray, n: int) -> None:
    buf += struct.pack("<Q", n)


def _enc(obj: Any, buf: bytearray, allow_pickle: bool, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TypeError(f"object nests deeper than {MAX_DEPTH} levels")
    if obj is None:
        buf += b"N"
    elif obj is True:
        buf += b"T"
    elif obj is False:
        buf += b"F"
    elif type(obj) is int:
        text = str(obj).encode()
        buf += b"i"
        _pack_len(buf, len(text))
        buf += text
    elif type(obj) is float:
        buf += b"f" + struct.pack("<d", obj)
    elif type(obj) is str:
        data = obj.encode("utf-8")
        buf += b"s"
        _pack_len(buf, len(data))
        buf += data
    elif type(obj) in (bytes, bytearray, memoryview):
        data = bytes(obj)
        buf += b"b"
        _pack_len(buf, len(data))
        buf += data
    elif type(obj) in (list, tuple):
        buf += b"l" if type(obj) is list else b"t"
        _pack_len(buf, len(obj))
        for item in obj:
            _enc(item, buf, allow_pickle, depth + 1)
    elif type(obj) is dict:
        buf += b"d"
        _pack_len(buf, len(obj))
        for key, value in obj.items():
            if type(key) is not str:
                raise TypeError(f"dict keys must be str to travel safely, got {type(key).__name__} {key!r}")
            _enc(key, buf, allow_pickle, depth + 1)
            _enc(value, buf, allow_pickle, depth + 1)
    elif isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
        name = dtype_name(obj.dtype)
        if name not in _DTYPES:
            raise TypeError(f"tensors of dtype {obj.dtype} cannot travel in the safe encoding")
        header = name.encode()
        buf += b"x"
        _pack_len(buf, len(header))
        buf += header
        _pack_len(buf, obj.dim())
        for size in obj.shape:
            _pack_len(buf, size)
        data = tensor_bytes(obj)
        _pack_len(buf, len(data))
        buf += data
    elif allow_pickle:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        buf += b"P"
        _pack_len(buf, len(data))
        buf += data
    else:
        raise TypeError(
            f"{type(obj).__name__} cannot travel in the safe encoding (None, bool, int, float, str, bytes, "
            "list, tuple, dict with str keys, tensors); convert it, or make the group with allow_pickle=True"
        )


def encode(obj: Any, *, allow_pickle: bool = False) -> bytes:
    """Encode ``obj``; raises ``TypeError`` for anything outside the safe set unless pickle is allowed."""
    buf = bytearray(_MAGIC)
    _enc(obj, buf, allow_pickle, 0)
    return bytes(buf)


class _Reader:
    def __init__(self, data: bytes, allow_pickle: bool) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.allow_pickle = allow_pickle

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError("truncated message")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def length(self) -> int:
        """A length or count; never more than the bytes left, so nothing is allocated for absent data."""
        n = int(struct.unpack("<Q", self.take(8))[0])
        if n > len(self.data) - self.pos:
            raise ProtocolError(f"length {n} exceeds the {len(self.data) - self.pos} bytes left")
        return n

    def text(self) -> str:
        try:
            return bytes(self.take(self.length())).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"string is not valid UTF-8: {e}") from None

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ProtocolError(f"message nests deeper than {MAX_DEPTH} levels")
        tag = bytes(self.take(1))
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"i":
            digits = bytes(self.take(self.length()))
            if not 0 < len(digits) <= MAX_INT_DIGITS or not _INT.fullmatch(digits):
                raise ProtocolError("malformed integer")
            return int(digits)
        if tag == b"f":
            return struct.unpack("<d", self.take(8))[0]
        if tag == b"s":
            return self.text()
        if tag == b"b":
            return bytes(self.take(self.length()))
        if tag in (b"l", b"t"):
            items = [self.value(depth + 1) for _ in range(self.length())]
            return items if tag == b"l" else tuple(items)
        if tag == b"d":
            out = {}
            for _ in range(self.length()):
                key = self.dict_key(depth + 1)
                if key in out:
                    raise ProtocolError(f"dict key {key[:80]!r} appears twice")
                out[key] = self.value(depth + 1)
            return out
        if tag == b"x":
            dtype = dtype_from_name(self.text())
            dims = self.length()
            if dims > MAX_DIMS:
                raise ProtocolError(f"tensor with {dims} dimensions (at most {MAX_DIMS})")
            shape = tuple(int(struct.unpack("<Q", self.take(8))[0]) for _ in range(dims))
            return tensor_from_bytes(self.take(self.length()), dtype, shape)
        if tag == b"P":
            data = bytes(self.take(self.length()))
            if not self.allow_pickle:
                raise ProtocolError(
                    "a peer sent a pickled object but this group does not allow pickle (allow_pickle=False)"
                )
            return pickle.loads(data)
        raise ProtocolError(f"unknown tag {tag!r} in message")

    def dict_key(self, depth: int) -> str:
        key = self.value(depth)
        if type(key) is not str:
            raise ProtocolError("dict key on the wire is not a str")
        return key


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
    reader = _Reader(data, allow_pickle)
    reader.pos = len(_MAGIC)
    value = reader.value(0)
    if reader.pos != len(data):
        raise ProtocolError(f"{len(data) - reader.pos} trailing bytes after message")
    return value
