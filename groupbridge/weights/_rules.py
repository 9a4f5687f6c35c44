"""Layouts that are rules: a source whose boxes are ``torch.chunk`` pieces (FSDP's, a tensor- or
expert-parallel split, a DTensor's ``Shard`` placements) posts the rule once and its place in it, not a box
per tensor.

A box along one dimension is piece ``i`` of ``n`` of ``torch.chunk`` when it starts at ``i * ceil(G / n)``
and runs for ``min(ceil(G / n), G - start)``. A source finds such an ``(n, i)`` per dimension of each box
(``n = 1`` for a whole dimension) and posts, grouped by ``n`` per dimension (the tensor's *key*), the tensors
and their global shapes (the **rule**: the same on every rank of an FSDP job, so the gather carries it
once) and its index per key (**at**: a few numbers). Every member then knows all the ranks of a *family*
(the sources posting one rule and one manifest) from the rule and their indices, and finds the ones whose
box of a tensor overlaps a given box by arithmetic: a planner reads sources' layouts in time that grows with
the families, not with the sources times the tensors. A box that is no chunk piece travels as it is.

A source that holds nothing of a tensor (the ranks past the last of ``torch.chunk``'s pieces: at 512 FSDP
ranks a norm of 64 values leaves 448 of them empty) names it among the tensors it holds **none** of: the
ranks past a tensor's end post one list alike, which the gather carries once, where a box each would grow
with the ranks times the small tensors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProtocolError
from .manifest import Manifest
from .shard import Box

Key = tuple[int, ...]
"""A tensor's pieces per dimension (``n``, 1 where the dimension is whole)."""
MAX_DIMS = 16


def chunk_range(size: int, n: int, i: int) -> tuple[int, int]:
    """Piece ``i`` of ``n`` of a dimension of ``size``, as ``torch.chunk`` cuts it: (start, length)."""
    step = -(-size // n)
    start = min(i * step, size)
    return start, max(0, min(step, size - start))


def _piece(size: int, start: int, length: int) -> tuple[int, int] | None:
    """(n, i) such that piece i of n of ``size`` is [start, start + length), or None. A piece as long as
    its step gives n at once; the last piece, shorter, the smallest step that divides its start."""
    if start == 0 and length == size:
        return 1, 0
    if length <= 0:
        return None
    steps = [length] if start + length < size else [length, *_divisors(start, above=length)]
    for step in steps:
        if start % step:
            continue
        n = -(-size // step)
        if -(-size // n) == step and chunk_range(size, n, start // step) == (start, length):
            return n, start // step
    return None


def _divisors(n: int, above: int) -> list[int]:
    """The divisors of ``n`` greater than ``above``, smallest first."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(d for d in {*small, *(n // d for d in small)} if d > above)


Compressed = tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None, list[str] | None]
"""A source's boxes for its post: (explicit boxes, rule, at, none); None for each it has none of."""


def compress(shards: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]], manifest: Manifest) -> Compressed:
    """A source's boxes as (explicit boxes, rule, at, none) for its post (see the module's docstring)."""
    shapes = {e.name: e.shape for e in manifest.entries}
    explicit: dict[str, Any] = {}
    rule: dict[str, list[Any]] = {}
    at: dict[str, list[int]] = {}
    none: list[str] = []
    for name, (g, o) in shards.items():
        if math.prod(g) and not math.prod(shapes[name]):
            none.append(name)
            continue
        pieces = [_piece(size, start, length) for size, start, length in zip(g, o, shapes[name], strict=True)]
        if not pieces or any(p is None for p in pieces):
            explicit[name] = [list(g), list(o)]
            continue
        key = ",".join(str(p[0]) for p in pieces if p is not None)
        index = [p[1] for p in pieces if p is not None]
        if at.setdefault(key, index) != index:  # one place per key: another index travels as it is
            explicit[name] = [list(g), list(o)]
            continue
        rule.setdefault(key, []).append([name, list(g)])
    return explicit or None, rule or None, at or None, none or None


@dataclass(slots=True)
class Family:
    """The sources that post one rule over one manifest: each tensor's key and global shape, and each
    source's index per key."""

    tensors: dict[str, tuple[Key, tuple[int, ...], str]]
    """name -> (key, global shape, wire dtype)."""
    at: dict[int, dict[Key, tuple[int, ...]]] = field(default_factory=dict)
    """rank -> its index per key."""
    _ranks: dict[Key, dict[tuple[int, ...], tuple[int, ...]]] | None = None

    def box(self, rank: int, name: str) -> Box:
        key, g, _ = self.tensors[name]
        return _box_of(g, key, self.at[rank][key])

    @staticmethod
    def _posted(
        places: dict[tuple[int, ...], tuple[int, ...]],
        g: tuple[int, ...],
        key: Key,
        bounds: list[tuple[int, int, int]],
    ) -> list[tuple[Box, tuple[int, ...], tuple[Key, tuple[int, ...]]]]:
        out = []
        for index in sorted(places):
            if all(first <= i <= last for i, (_, first, last) in zip(index, bounds, strict=True)):
                found = _box_of(g, key, index)
                if found.numel:
                    out.append((found, places[index], (key, index)))
        return out

    def overlapping(
        self, name: str, box: Box
    ) -> list[tuple[Box, tuple[int, ...], tuple[Key, tuple[int, ...]]]]:
        """(box, its holders, (key, index)) of every place of this family whose box of ``name`` overlaps
        ``box``."""
        key, g, _ = self.tensors[name]
        if self._ranks is None:
            self._ranks = {}
            for rank in sorted(self.at):
                for k, index in self.at[rank].items():
                    by = self._ranks.setdefault(k, {})
                    by[index] = (*by.get(index, ()), rank)
        places = self._ranks.get(key, {})
        bounds = []  # per dimension: the step and the first and last index overlapping the box
        for size, n, lo, length in zip(g, key, box.offset, box.shape, strict=True):
            step = max(1, -(-size // n))
            first, last = lo // step, min((lo + length - 1) // step, n - 1)
            if length <= 0 or first > last:
                return []
            bounds.append((step, first, last))
        if math.prod(last - first + 1 for _, first, last in bounds) > len(places):
            # fewer places than indices (a sparse or a hostile rule): read the places posted, in index order
            return self._posted(places, g, key, bounds)
        spans = [
            [(i, i * step, min(step, size - i * step)) for i in range(first, last + 1)]
            for size, (step, first, last) in zip(g, bounds, strict=True)
        ]
        split = [d for d, n in enumerate(key) if n > 1]
        out = []
        if len(split) == 1:  # the common case (FSDP, a TP split): one dimension's pieces, no product
            d, zero = split[0], (0,) * len(key)
            offset, shape = [s[0][1] for s in spans], [s[0][2] for s in spans]
            for i, start, length in spans[d]:
                index = (*zero[:d], i, *zero[d + 1 :])
                ranks = places.get(index)
                if ranks is not None:
                    offset[d], shape[d] = start, length
                    if all(shape):
                        out.append((Box(tuple(offset), tuple(shape)), ranks, (key, index)))
            return out
        for combo in itertools.product(*spans):
            index = tuple(c[0] for c in combo)
            ranks = places.get(index)
            if ranks is not None and all(c[2] > 0 for c in combo):
                found = Box(tuple(c[1] for c in combo), tuple(c[2] for c in combo))
                out.append((found, ranks, (key, index)))
        return out


def _box_of(g: tuple[int, ...], key: Key, index: tuple[int, ...]) -> Box:
    ranges = [chunk_range(size, n, i) for size, n, i in zip(g, key, index, strict=True)]
    return Box(tuple(s for s, _ in ranges), tuple(n for _, n in ranges))


def family_of(manifest: Manifest, rule: Any, src: int) -> Family:
    """A family's tensors from one source's rule (checked as hostile: keys, names, shapes)."""
    if not isinstance(rule, dict):
        raise ProtocolError(f"rank {src}'s rule is malformed")
    dtypes = {e.name: e.wire_dtype for e in manifest.entries}
    tensors: dict[str, tuple[Key, tuple[int, ...], str]] = {}
    for text, names in rule.items():
        key = _key(text, src)
        if not isinstance(names, list):
            raise ProtocolError(f"rank {src}'s rule is malformed")
        for item in names:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and item[0] in dtypes
                and isinstance(item[1], list)
            ):
                raise ProtocolError(
                    f"rank {src}'s rule names a tensor its manifest does not, or is malformed"
                )
            g = tuple(item[1])
            if len(g) != len(key) or not all(type(v) is int and 0 <= v < 1 << 62 for v in g):
                raise ProtocolError(f"rank {src}'s rule gives {item[0]!r} a malformed global shape")
            tensors[item[0]] = (key, g, dtypes[item[0]])
    return Family(tensors)


def place_of(at: Any, family: Family, src: int) -> dict[Key, tuple[int, ...]]:
    """A source's index per key in its family (checked as hostile)."""
    keys = {k for k, _, _ in family.tensors.values()}
    if not isinstance(at, dict):
        raise ProtocolError(f"rank {src}'s place in its rule is malformed")
    out: dict[Key, tuple[int, ...]] = {}
    for text, index in at.items():
        key = _key(text, src)
        if not (
            isinstance(index, list)
            and len(index) == len(key)
            and all(type(i) is int and 0 <= i < n for i, n in zip(index, key, strict=True))
        ):
            raise ProtocolError(f"rank {src}'s place in its rule is malformed")
        out[key] = tuple(index)
    if not keys <= set(out):
        raise ProtocolError(f"rank {src}'s rule has a key it gives no place in")
    return out


def _key(text: Any, src: int) -> Key:
    try:
        key = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        raise ProtocolError(f"rank {src}'s rule has a malformed key") from None
    if not 0 < len(key) <= MAX_DIMS or not all(0 < n < 1 << 31 for n in key):
        raise ProtocolError(f"rank {src}'s rule has a malformed key")
    return key
