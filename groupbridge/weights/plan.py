"""The bucket plan: where every tensor's bytes sit in the byte stream of a sync, and how the stream is cut.

Both sides compute it from the manifest alone, so no per-bucket metadata crosses the wire. Tensors are laid
one after another, each at an offset aligned to its element size (so a received byte range can be viewed as
that dtype in place). The stream is then cut into buckets:

- a tensor of at least ``solo_bytes`` travels in buckets of its own (cut at ``bucket_bytes``), so both sides
  send and receive it straight from and into its own storage, with no packing copy, whatever their memory
  layout;
- smaller tensors are packed together into buckets of up to ``bucket_bytes``.

The layout of the stream does not depend on the cuts, so :func:`groupbridge.flatten_` lays a model out in
exactly this byte layout for any bucket size, and a side laid out so sends or receives every bucket in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .manifest import Manifest

__all__ = ["Plan", "PlanCache", "Segment", "stream_offsets"]


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


@dataclass(frozen=True, slots=True)
class Plan:
    offsets: tuple[int, ...]
    """Stream offset of each manifest entry (aliases: their target's offset)."""
    total_bytes: int
    bucket_bytes: int
    bounds: tuple[tuple[int, int], ...]
    """Each bucket's [start, end) in the stream."""
    buckets: tuple[tuple[Segment, ...], ...]

    def bucket_range(self, k: int) -> tuple[int, int]:
        return self.bounds[k]

    @classmethod
    def of_sizes(cls, sizes: Sequence[int]) -> Plan:
        """Buckets of these sizes back to back, for a stream that is not one manifest's bytes (a many-source
        sync's pairs): transports read only the bounds."""
        bounds, pos = [], 0
        for n in sizes:
            bounds.append((pos, pos + n))
            pos += n
        return cls((), pos, max(sizes, default=0), tuple(bounds), tuple(() for _ in sizes))

    @classmethod
    def build(cls, manifest: Manifest, bucket_bytes: int, solo_bytes: int | None = None) -> Plan:
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
        return cls(tuple(offsets), total, bucket_bytes, tuple(bounds), tuple(tuple(b) for b in buckets))


class PlanCache:
    """The last plan built, reused while the manifest and the sizes are unchanged (building one walks every
    tensor: for a model of thousands of tensors, milliseconds per sync)."""

    def __init__(self) -> None:
        self._key: tuple[str, int, int | None] | None = None
        self._plan: Plan | None = None

    def get(self, manifest: Manifest, bucket_bytes: int, solo_bytes: int | None) -> Plan:
        key = (manifest.digest, bucket_bytes, solo_bytes)
        if self._plan is None or self._key != key:
            self._key, self._plan = key, Plan.build(manifest, bucket_bytes, solo_bytes)
        return self._plan
