"""groupbridge: global groups, bridges between independent jobs, and weight sync for PyTorch.

Importing this package has no side effects: no logging setup, no environment changes, no threads.
"""

from __future__ import annotations

from .control import ControlChannel, Deadline
from .devices import accelerator, split_backend
from .errors import (
    GroupBridgeError,
    GroupClosedError,
    GroupMismatchError,
    JoinTimeoutError,
    ManifestMismatchError,
    PeerDiedError,
    PeerTimeoutError,
    ProtocolError,
    StoreUnreachableError,
    SyncRefusedError,
    TornUpdateError,
    TransportRefusedError,
    TransportUnavailableError,
    VerificationError,
    VLLMCompatError,
    WeightSyncError,
)
from .global_group import GlobalGroup, destroy_global_group, init_global_group
from .net import Address, Listener, listen
from .stateless import StatelessGroup, Work
from .weights import (
    BroadcastOptions,
    P2POptions,
    RelayOptions,
    SharedOptions,
    SyncStats,
    WeightReceiver,
    WeightSender,
    WeightUpdate,
    flatten_,
)
from .weights.shard import Box, Shard

__version__ = "0.1.0"

__all__ = [
    "Address",
    "Box",
    "BroadcastOptions",
    "ControlChannel",
    "Deadline",
    "GlobalGroup",
    "GroupBridgeError",
    "GroupClosedError",
    "GroupMismatchError",
    "JoinTimeoutError",
    "Listener",
    "ManifestMismatchError",
    "P2POptions",
    "PeerDiedError",
    "PeerTimeoutError",
    "ProtocolError",
    "RelayOptions",
    "Shard",
    "SharedOptions",
    "StatelessGroup",
    "StoreUnreachableError",
    "SyncRefusedError",
    "SyncStats",
    "TornUpdateError",
    "TransportRefusedError",
    "TransportUnavailableError",
    "VLLMCompatError",
    "VerificationError",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightUpdate",
    "Work",
    "__version__",
    "accelerator",
    "destroy_global_group",
    "flatten_",
    "init_global_group",
    "listen",
    "split_backend",
]
