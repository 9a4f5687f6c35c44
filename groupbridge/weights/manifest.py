"""The manifest: what a weight sync carries, checked against what each receiver expects before bytes move.

Entries are in the order of the sender's named tensors. A name whose tensor shares storage with an earlier
one (tied weights) is an alias: it travels once and lands in both names.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..codec import dtype_from_name, dtype_name
from ..errors import ProtocolError
from .shard import box_of

__all__ = ["Entry", "Manifest", "compare", "expected_specs", "mismatch_message", "tensors_of"]

SHOW = 20
MAX_ENTRIES = 1 << 20
MAX_NAME = 4096
MAX_DIMS = 16
MAX_NUMEL = 1 << 40
MAX_TOTAL_BYTES = 1 << 44
"""Bounds on a manifest read from the wire (16 TiB, a million tensors): anything larger is hostile."""


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    """The sender's dtype."""
    wire_dtype: str
    """The dtype the bytes travel (and arrive) in."""
    alias_of: str | None = None
    """For tied weights: the earlier name whose bytes this name shares."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return dtype_from_name(self.wire_dtype).itemsize

    @property
    def nbytes(self) -> int:
        return 0 if self.alias_of is not None else self.numel * self.element_size

    def to_wire(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype, self.wire_dtype, self.alias_of]

    @classmethod
    def from_wire(cls, item: Any) -> Entry:
        """Parse one entry; anything malformed is a :class:`ProtocolError` naming what."""
        if not isinstance(item, (list, tuple)) or len(item) != 5:
            raise ProtocolError("manifest entry is not a list of 5 fields")
        name, shape, dtype, wire, alias = item
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise ProtocolError(f"manifest entry name {str(name)[:80]!r} is not a str of 1-{MAX_NAME} chars")
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
            raise ProtocolError(f"{name}: shape is not a list of at most {MAX_DIMS} sizes")
        if not all(type(size) is int and size >= 0 for size in shape):
            raise ProtocolError(f"{name}: shape {str(shape)[:80]} holds a size that is not an int >= 0")
        if (numel := math.prod(shape)) > MAX_NUMEL:
            raise ProtocolError(f"{name}: {numel} elements is more than {MAX_NUMEL}")
        if not isinstance(dtype, str) or not isinstance(wire, str):
            raise ProtocolError(f"{name}: dtypes are not strings")
        dtype_from_name(dtype)
        dtype_from_name(wire)
        if alias is not None and not isinstance(alias, str):
            raise ProtocolError(f"{name}: alias_of is not a str")
        return cls(name, tuple(shape), dtype, wire, alias)


@dataclass(frozen=True)
class Manifest:
    entries: tuple[Entry, ...]

    @functools.cached_property
    def digest(self) -> str:
        blob = json.dumps(self.to_wire(), separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @functools.cached_property
    def sources(self) -> tuple[int, ...]:
        """For each entry, the index of the entry whose bytes it holds (itself, or a tied weight's target)."""
        index = {e.name: i for i, e in enumerate(self.entries)}
        return tuple(i if e.alias_of is None else index[e.alias_of] for i, e in enumerate(self.entries))

    def to_wire(self) -> list[list[Any]]:
        """The entries as they travel: one list, made once and shared by every caller (do not change it). A
        repeat send posts the same manifest object, so its post is then the same list: found unchanged
        without comparing its entries (``_posts.Posts.post``)."""
        return self._wire

    @functools.cached_property
    def _wire(self) -> list[list[Any]]:
        return [e.to_wire() for e in self.entries]

    @classmethod
    def from_wire(cls, items: Any) -> Manifest:
        """Parse a manifest from the wire: bounded, no duplicate names, aliases name an earlier tensor."""
        if not isinstance(items, (list, tuple)) or len(items) > MAX_ENTRIES:
            raise ProtocolError(f"manifest is not a list of at most {MAX_ENTRIES} entries")
        entries = tuple(Entry.from_wire(i) for i in items)
        seen: dict[str, Entry] = {}
        total = 0
        for e in entries:
            if e.name in seen:
                raise ProtocolError(f"manifest names {e.name!r} twice")
            if e.alias_of is not None:
                target = seen.get(e.alias_of)
                if target is None or target.alias_of is not None:
                    raise ProtocolError(f"{e.name}: alias_of {e.alias_of!r} is not an earlier tensor")
            seen[e.name] = e
            total += e.nbytes
        if total > MAX_TOTAL_BYTES:
            raise ProtocolError(f"manifest describes {total} bytes, more than {MAX_TOTAL_BYTES}")
        return cls(entries)

    @classmethod
    def build(
        cls,
        named: Iterable[tuple[str, torch.Tensor]],
        wire_dtype: torch.dtype | None = None,
        like: Manifest | None = None,
    ) -> Manifest:
        """Describe ``named`` tensors, detecting tied ones (same storage, offset, shape and strides).
        ``like``: the previous send's manifest, returned itself (its digest made already) when the tensors
        match it entry for entry, as a training loop's do every step."""
        entries = []
        at: dict[int, list[tuple[str, torch.Tensor]]] = {}
        """The tensors met so far by address: only those sharing one are compared further."""
        names: set[str] = set()
        before = like.entries if like is not None else ()
        same = True
        for i, (name, t) in enumerate(named):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
            if name in names:
                raise ValueError(f"tensor name {name!r} appears twice")
            names.add(name)
            wire = t.dtype
            if wire_dtype is not None and t.dtype.is_floating_point:
                wire = wire_dtype
            alias = None
            if not t.is_meta and t.numel():  # no bytes, nothing to share
                same_address = at.setdefault(t.data_ptr(), [])
                if same_address:
                    key = _identity(t)
                    alias = next((n for n, u in same_address if _identity(u) == key), None)
                if alias is None:
                    same_address.append((name, t))
            e = before[i] if i < len(before) else None
            if (
                e is None
                or e.name != name
                or e.shape != t.shape
                or e.alias_of != alias
                or DTYPE_NAMES.get(t.dtype) != e.dtype
                or DTYPE_NAMES.get(wire) != e.wire_dtype
            ):
                same = False
                e = Entry(name, tuple(t.shape), dtype_name(t.dtype), dtype_name(wire), alias)
            entries.append(e)
        if like is not None and same and len(entries) == len(before):
            return like
        return cls(tuple(entries))


DTYPE_NAMES = {d: dtype_name(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
"""Each dtype's name on the wire, looked up (a repeat send compares hundreds of thousands of them)."""


def _identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What two tied names share: the same bytes (address and device), viewed alike. Two live tensors with
    bytes at one address on one device share a storage."""
    if t.is_meta or t.numel() == 0:
        return None
    return (t.data_ptr(), t.device, t.shape, t.stride(), t.dtype)


def tensors_of(target: Any, what: str = "this") -> dict[str, Any]:
    """A module's state dict (parameters and buffers, tied names included) or a mapping, as a dict."""
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True))
    if isinstance(target, Mapping):
        return dict(target)
    raise TypeError(f"{what} takes a module or a mapping, got {type(target).__name__}")


def expected_specs(expected: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Normalise a module, a state dict, or a mapping of name -> (shape, dtype) to name -> (shape, dtype)."""
    expected = tensors_of(expected, "expected=")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, spec in expected.items():
        shard = box_of(spec)
        if shard is not None:  # a box of a global tensor: its global shape is what is expected
            out[name] = (shard.global_shape, dtype_name(shard.tensor.dtype))
        elif isinstance(spec, torch.Tensor):
            out[name] = (tuple(spec.shape), dtype_name(spec.dtype))
        else:
            shape, dtype = spec
            out[name] = (tuple(shape), dtype if isinstance(dtype, str) else dtype_name(dtype))
    return out


def compare(manifest: Manifest, expected: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, list[str]]:
    """The problems by kind (missing, unexpected, shape, dtype; empty lists when all match), by the
    receiver's names (after any rename). The dtype compared is the wire dtype: what will arrive."""
    sent = {e.name: e for e in manifest.entries}
    problems: dict[str, list[str]] = {"missing": [], "unexpected": [], "shape": [], "dtype": []}
    for name in expected:
        if name not in sent:
            problems["missing"].append(name)
    for name, e in sent.items():
        if name not in expected:
            problems["unexpected"].append(name)
            continue
        shape, dtype = expected[name]
        if tuple(shape) != e.shape:
            problems["shape"].append(f"{name}: sender {list(e.shape)}, receiver {list(shape)}")
        if dtype != e.wire_dtype:
            problems["dtype"].append(f"{name}: arrives as {e.wire_dtype}, receiver holds {dtype}")
    return problems


def mismatch_message(problems: dict[str, list[str]], who: str) -> str:
    labels = {
        "missing": "missing (the receiver has them, the sender does not send them)",
        "unexpected": "unexpected (sent, but the receiver has no such name)",
        "shape": "shape mismatches",
        "dtype": "dtype mismatches",
    }
    parts = [f"manifest mismatch at {who}:"]
    for kind, items in problems.items():
        if items:
            shown = ", ".join(items[:SHOW])
            more = f" ... and {len(items) - SHOW} more" if len(items) > SHOW else ""
            parts.append(f"  {len(items)} {labels[kind]}: {shown}{more}")
    return "\n".join(parts)
