"""What a finished sync reports to its source."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["SyncStats"]


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
    """Payload bytes each receiver (by rank) took from this sender: all of ``bytes`` when one source sends
    whole tensors; its boxes with many sources, or when a receiver takes only the slices it reads (a
    tensor-parallel engine worker)."""

    @property
    def gbps(self) -> float:
        """Deprecated name of :attr:`gb_per_s` (gigabytes per second, not gigabits)."""
        return self.gb_per_s
