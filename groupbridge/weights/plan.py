"""The cut of a stream: its buckets' bounds and what each holds, one type for every stream of a sync.

A fan-out stream carries a manifest's bytes (buckets of :class:`Segment`, cut by :meth:`Plan.build`);
a pair, boxes of global tensors (of :class:`._shard_plan.Piece`, cut by :class:`._shard_plan.ShardPlan`);
a delta's payloads and a forwarder's stream, bytes only.

Both sides compute a fan-out stream's cut from the manifest alone, so no per-bucket metadata crosses the
wire. Tensors lie one after another, each at an offset aligned to its element size (so a received byte range
can be viewed as that dtype in place), and the stream is cut into buckets:

- a tensor of at least ``solo_bytes`` travels in buckets of its own (cut at ``bucket_bytes``), sent from
  and received into its own storage with no packing copy, whatever either side's memory layout;
- smaller tensors are packed together into buckets of up to ``bucket_bytes``.

The layout does not depend on the cut, so :func:`groupbridge.flatten_` lays a model out in it for any bucket
size, and a side laid out so sends or receives every bucket in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import torch
from typing_extensions import TypeVar as DefaultTypeVar

from .manifest import Manifest

__all__ = ["Plan", "Plans", "Segment", "stream_offsets"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of one tensor inside one bucket."""

    index: int
    """Entry index in the manifest."""
    tensor_offset: int
    """Byte offset inside the tensor."""
    bucket_offset: int
    """Byte offset inside the bucket."""
    nbytes: int

    @property
    def key(self) -> int:
        """The tensor it is a part of (see ``_shard_plan.Piece.key``): its manifest index."""
        return self.index

    def part(self, slot: tuple[torch.Tensor, Any]) -> tuple[int, int, torch.Tensor, torch.dtype]:
        """Its bytes in the tensor ``slot`` holds (contiguous, wire dtype), as a ``_bytes.Part``."""
        flat = slot[0].reshape(-1).view(torch.uint8)[self.tensor_offset : self.tensor_offset + self.nbytes]
        return self.bucket_offset, self.nbytes, flat, torch.uint8


def stream_offsets(manifest: Manifest) -> tuple[list[int], int]:
    """Each entry's offset in the byte stream (aliases share their target's) and the stream's length."""
    offsets: list[int] = []
    pos = 0
    for i, e in enumerate(manifest.entries):
        if e.alias_of is not None:
            offsets.append(offsets[manifest.sources[i]])
        else:
            align = e.element_size
            pos = (pos + align - 1) // align * align
            offsets.append(pos)
            pos += e.nbytes
    return offsets, pos


C = DefaultTypeVar("C", default=Segment)
"""What a bucket holds: a fan-out stream's segments, a pair's pieces."""


@dataclass(frozen=True, slots=True)
class Plan(Generic[C]):
    offsets: tuple[int, ...]
    """A fan-out stream's offset of each manifest entry (aliases: their target's offset); else empty."""
    total_bytes: int
    bucket_bytes: int
    bounds: tuple[tuple[int, int], ...]
    """Each bucket's [start, end) in the stream."""
    buckets: tuple[tuple[C, ...], ...]

    def bucket_range(self, k: int) -> tuple[int, int]:
        return self.bounds[k]

    @staticmethod
    def of_sizes(sizes: Sequence[int], contents: Sequence[tuple[C, ...]] | None = None) -> Plan[C]:
        """Buckets of these sizes back to back, for a stream that is not one manifest's bytes (holding
        ``contents``, or nothing: a stream whose transport reads only the bounds)."""
        ends = list(itertools.accumulate(sizes, initial=0))
        held = tuple(contents) if contents is not None else tuple(() for _ in sizes)
        return Plan((), ends[-1], max(sizes, default=0), tuple(itertools.pairwise(ends)), held)

    @staticmethod
    def build(manifest: Manifest, bucket_bytes: int, solo_bytes: int | None = None) -> Plan[Segment]:
        """Cut the manifest's stream; ``solo_bytes`` defaults to ``bucket_bytes // 8``."""
        if bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least 1024)")
        solo = max(1, bucket_bytes // 8) if solo_bytes is None else solo_bytes
        offsets, total = stream_offsets(manifest)
        bounds: list[tuple[int, int]] = []
        open_start: int | None = None  # start of the bucket of small tensors being filled
        open_end = 0
        for i, e in enumerate(manifest.entries):
            if e.alias_of is not None or e.nbytes == 0:
                continue
            start, end = offsets[i], offsets[i] + e.nbytes
            if e.nbytes >= solo:
                if open_start is not None:
                    bounds.append((open_start, open_end))
                    open_start = None
                bounds += [(s, min(end, s + bucket_bytes)) for s in range(start, end, bucket_bytes)]
                continue
            if open_start is not None and end - open_start > bucket_bytes:
                bounds.append((open_start, open_end))
                open_start = None
            if open_start is None:
                open_start = start
            open_end = end
        if open_start is not None:
            bounds.append((open_start, open_end))
        buckets: list[list[Segment]] = [[] for _ in bounds]
        k = 0
        for i, e in enumerate(manifest.entries):
            if e.alias_of is not None or e.nbytes == 0:
                continue
            start, end = offsets[i], offsets[i] + e.nbytes
            while bounds[k][1] <= start:
                k += 1
            pos = start
            while pos < end:
                b_start, b_end = bounds[k]
                piece = min(end, b_end) - pos
                buckets[k].append(Segment(i, pos - start, pos - b_start, piece))
                pos += piece
                if pos < end:
                    k += 1
        return Plan(tuple(offsets), total, bucket_bytes, tuple(bounds), tuple(tuple(b) for b in buckets))


MERGED_BYTES = 1 << 30
"""The cut of a stream whose members all lie in the plan's byte layout (both sides ``flatten_``-ed) over a
transport that cuts anywhere (``TransportSpec.cut_anywhere``: the group's broadcast), instead of
``bucket_bytes``: nothing is packed, and fewer operations are faster (each gloo one costs a handshake)."""


class Plans:
    """A member's last plans (fan-out, pair), each reused while what it depends on is unchanged: building
    one walks every tensor (a fan-out plan: milliseconds for thousands of tensors; a pair plan every cell of
    every tensor in Python: about 0.2 s per sync on every member, 290 tensors, 4 sources, 4 receivers,
    2 cores, as long as the dense sync it plans on one host)."""

    KEPT = 4

    def __init__(self) -> None:
        self._kept: dict[Hashable, Any] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The plan kept under ``key``, else ``make()``'s (a plan that raised is not kept)."""
        value = self._kept.pop(key) if key in self._kept else make()
        self._kept[key] = value
        while len(self._kept) > self.KEPT:
            self._kept.pop(next(iter(self._kept)))
        return cast(T, value)

    def whole(self, manifest: Manifest, bucket_bytes: int, solo_bytes: int | None) -> Plan:
        """The fan-out plan of ``manifest`` cut at these sizes."""
        key = ("whole", manifest.digest, bucket_bytes, solo_bytes)
        return self.get(key, lambda: Plan.build(manifest, bucket_bytes, solo_bytes))

    def merged(self, manifest: Manifest) -> Plan:
        """The fan-out plan of ``manifest`` cut at :data:`MERGED_BYTES`: what tensors laid out in place are
        checked against, and the cut where every member's are."""
        return self.whole(manifest, MERGED_BYTES, MERGED_BYTES)
