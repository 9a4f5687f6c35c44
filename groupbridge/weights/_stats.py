"""What a finished sync reports to its source."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..stateless import StatelessGroup


@dataclass(frozen=True, slots=True)
class SyncStats:
    version: int
    bytes: int
    seconds: float
    gb_per_s: float
    """Payload gigabytes (1e9 bytes, not bits) per second, as seen by the sender."""
    buckets: int
    in_place_buckets: int
    """Buckets sent straight from the tensors' own storage, without packing."""
    transport: str
    receivers: int
    wire_bytes: int = 0
    """Payload bytes that travelled: ``bytes`` for a full sync, the changed buckets' encodings for a delta."""
    changed_fraction: float = 1.0
    """Of the words compared, the fraction that changed (1.0 for a full sync: nothing was compared)."""
    delta: bool = False
    """This sync travelled as a delta against the version every receiver held."""
    base_bytes: int = 0
    """Memory the sender holds for deltas (``WeightSender(delta=True)``): a copy of the model's wire bytes."""
    by_receiver: Mapping[int, int] = field(default_factory=dict)
    """Payload bytes each receiver (by rank) took from this sender: all of ``bytes`` from one source of whole
    tensors, else its boxes (many sources, or a receiver taking only the slices it reads)."""


def finished(group: StatelessGroup, version: int, total: int, seconds: float, **fields: Any) -> SyncStats:
    """What a source's sync (any plan) reports: its stats, logged once."""
    stats = SyncStats(version=version, bytes=total, seconds=seconds,
                      gb_per_s=total / seconds / 1e9 if seconds > 0 else float("inf"), **fields)  # fmt: skip
    group.log.info(
        "sent version %d%s: %.1f MB (%.1f MB on the wire) in %.3fs (%.2f GB/s, %d buckets, %d in place, "
        "%s, %d receivers)", version,
        f" as a delta ({stats.changed_fraction:.2%} changed)" if stats.delta else "",
        total / 1e6, stats.wire_bytes / 1e6, seconds, stats.gb_per_s, stats.buckets, stats.in_place_buckets,
        stats.transport, len(stats.by_receiver),
    )  # fmt: skip
    return stats
