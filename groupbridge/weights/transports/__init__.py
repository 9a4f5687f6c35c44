"""The transports that move a sync's buckets, each described by its :class:`TransportSpec`:

- ``broadcast``: the group's own broadcast (gloo on CPU, NCCL & co. on devices).
- ``relay``: a chunked, pipelined chain over the group's send/recv, so each link carries the bytes once.
- ``shm``: a ring of shared-memory segments on one host; the sender fills, receivers copy out in parallel.
- ``cuda_ipc``: the same over CUDA IPC buffers, for CUDA tensors on one host.
- ``p2p``: point-to-point send/recv, each bucket to its own receiver: a many-source sync's pairs across hosts.

The sender chooses one (:func:`choose`) and names it, with its options, in the sync's header.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import TransportUnavailableError
from ...stateless import StatelessGroup
from .base import (
    Land,
    Landed,
    Landing,
    RxTransport,
    Sync,
    TransportOptions,
    TransportSpec,
    TxTransport,
)
from .broadcast import SPEC as BROADCAST
from .broadcast import BroadcastOptions
from .p2p import SPEC as P2P
from .p2p import P2POptions
from .relay import SPEC as RELAY
from .relay import RelayOptions
from .shared import CUDA_IPC, SHM, SharedOptions

__all__ = [
    "TRANSPORTS",
    "BroadcastOptions",
    "Land",
    "Landed",
    "Landing",
    "P2POptions",
    "RelayOptions",
    "RxTransport",
    "SharedOptions",
    "Sync",
    "TransportOptions",
    "TransportSpec",
    "TxTransport",
    "across_hosts",
    "choose",
    "pair_transport",
    "spec",
    "stream_device",
]

TRANSPORTS: dict[str, TransportSpec[Any]] = {s.name: s for s in (BROADCAST, RELAY, SHM, CUDA_IPC, P2P)}


def pair_transport(kind: str) -> str:
    """What carries a many-source sync's pairs from a source whose header names ``kind``: ``kind`` if its
    spec says ``pairs`` (``shm`` on one host), else ``p2p``."""
    return kind if spec(kind).pairs else "p2p"


def stream_device(kind: str, device: torch.device) -> torch.device:
    """Where a stream's buffers over ``kind`` live: on the tensors' ``device``, unless ``kind`` carries host
    memory only (``shm``: the host)."""
    carried = spec(kind).devices
    return device if not carried or device.type in carried else torch.device("cpu")


def spec(kind: str) -> TransportSpec[Any]:
    """The transport a header names; TransportUnavailableError for one this version does not know."""
    found = TRANSPORTS.get(kind)
    if found is None:
        raise TransportUnavailableError(
            f"the sender announced transport {kind!r}, which this version does not know"
        )
    return found


def across_hosts(group: StatelessGroup, device: torch.device) -> str:
    """``auto``'s choice when the members cannot share memory: for host tensors the group's broadcast to one
    receiver, a relay chain to more (gloo's broadcast is a star: the source's link carries the model once
    per receiver, 2.12x the link bound to two receivers at 200 Mbit/s where the chain is 1.10x to three);
    for device tensors the device group's broadcast up to two receivers (NCCL pipelines its own), a chain
    beyond."""
    if device.type == "cpu":
        return "broadcast" if group.world_size <= 2 else "relay"
    return "broadcast" if group.world_size <= 3 else "relay"


def _where(host_id: str) -> str:
    """A member's host identity for a message: host name, and its user when the identity names one."""
    parts = host_id.split("/")
    user = next((p for p in parts if p.startswith("uid:")), None)
    return f"{parts[0]} ({user})" if user else parts[0]


def choose(requested: str, group: StatelessGroup, device: torch.device) -> str:
    """The transport for this sync (``auto``: a one-host one where it fits, else :func:`across_hosts`'s);
    an explicit one that cannot work here is an error, never a fallback.

    Raises:
        ValueError: an unknown name.
        TransportUnavailableError: a one-host transport across hosts, or a device it does not carry.
    """
    local = len(set(group.host_ids)) == 1
    if requested == "auto":
        for candidate in TRANSPORTS.values():
            if candidate.one_host and local and device.type in candidate.devices:
                return candidate.name
        return across_hosts(group, device)
    chosen = TRANSPORTS.get(requested)
    if chosen is None:
        raise ValueError(f"transport={requested!r} is not one of auto, {', '.join(TRANSPORTS)}")
    if chosen.one_host and not local:
        hosts = ", ".join(f"rank {r}: {_where(h)}" for r, h in enumerate(group.host_ids))
        raise TransportUnavailableError(
            f"transport={requested!r} needs every member on one host, in one pid namespace, as one user; "
            f"members are on {hosts}"
        )
    if chosen.devices and device.type not in chosen.devices:
        others = [s.name for s in TRANSPORTS.values() if s.one_host and device.type in s.devices]
        hint = f"; use {others[0]!r}" if others else ""
        raise TransportUnavailableError(
            f"transport={requested!r} carries {'/'.join(d.upper() for d in chosen.devices)} "
            f"tensors; these are on {device}{hint}"
        )
    return requested
