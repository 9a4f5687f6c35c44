"""The bucket plan: where every tensor's bytes sit in the byte stream of a sync, and how it is cut.

Both sides compute it from the manifest alone, so no per-bucket metadata crosses the wire. Tensors are laid
one after another, each at an offset aligned to its element size (so a received byte range can be viewed as
that dtype in place); the stream is cut into buckets of ``bucket_bytes``, so a tensor bigger than a bucket
simply spans several. :func:`groupbridge.flatten_` lays a model out in exactly this byte layout, which is what
lets a side send or receive whole buckets in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifest import Manifest

__all__ = ["Plan", "Segment"]


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


@dataclass(frozen=True, slots=True)
class Plan:
    offsets: tuple[int, ...]
    """Stream offset of each manifest entry (aliases: their target's offset)."""
    total_bytes: int
    bucket_bytes: int
    buckets: tuple[tuple[Segment, ...], ...]

    def bucket_range(self, k: int) -> tuple[int, int]:
        start = k * self.bucket_bytes
        return start, min(self.total_bytes, start + self.bucket_bytes)

    @classmethod
    def build(cls, manifest: Manifest, bucket_bytes: int) -> Plan:
        if bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least 1024)")
        offsets: list[int] = []
        by_name: dict[str, int] = {}
        pos = 0
        for e in manifest.entries:
            if e.alias_of is not None:
                offsets.append(offsets[by_name[e.alias_of]])
                by_name[e.name] = len(offsets) - 1
                continue
            align = e.element_size
            pos = (pos + align - 1) // align * align
            offsets.append(pos)
            by_name[e.name] = len(offsets) - 1
            pos += e.nbytes
        total = pos
        n_buckets = (total + bucket_bytes - 1) // bucket_bytes
        buckets: list[list[Segment]] = [[] for _ in range(n_buckets)]
        for i, e in enumerate(manifest.entries):
            if e.alias_of is not None or e.nbytes == 0:
                continue
            start, end = offsets[i], offsets[i] + e.nbytes
            k = start // bucket_bytes
            while start < end:
                bucket_end = (k + 1) * bucket_bytes
                piece = min(end, bucket_end) - start
                buckets[k].append(Segment(i, start - offsets[i], start - k * bucket_bytes, piece))
                start += piece
                k += 1
        return cls(tuple(offsets), total, bucket_bytes, tuple(tuple(b) for b in buckets))
