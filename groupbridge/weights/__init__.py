"""Weight sync: manifest, bucket plan, sender, receiver, flatten_."""

from __future__ import annotations

from ._sharded_delta import DeltaMemory
from .flatten import flatten_
from .manifest import Manifest
from .plan import Plan
from .receiver import WeightReceiver, WeightUpdate
from .sender import DEFAULT_BUCKET_BYTES, SyncStats, WeightSender
from .transports import BroadcastOptions, P2POptions, RelayOptions, SharedOptions

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BroadcastOptions",
    "DeltaMemory",
    "Manifest",
    "P2POptions",
    "Plan",
    "RelayOptions",
    "SharedOptions",
    "SyncStats",
    "WeightReceiver",
    "WeightSender",
    "WeightUpdate",
    "flatten_",
]
