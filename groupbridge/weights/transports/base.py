"""The transport contract: what a transport is told, what it must do, and what it states about itself.

The sender, the handshake and the receiver never name a transport: they read its :class:`TransportSpec`
(the options it takes, what it can carry, what it can do) from :data:`TRANSPORTS`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from ...control import Deadline
from ...errors import ProtocolError, TransportUnavailableError
from ...stateless import StatelessGroup
from ..plan import Plan

__all__ = [
    "Land",
    "Landed",
    "Landing",
    "RxTransport",
    "Sync",
    "TransportOptions",
    "TransportSpec",
    "TxTransport",
    "wire_int",
]


class Landing(enum.Enum):
    """What the buffer a bucket lands in is, on a receiver."""

    TARGET = "target"
    """The caller's own tensors, in place: nothing to copy afterwards."""
    STAGING = "staging"
    """An atomic update's staging buffer."""
    SCRATCH = "scratch"
    """A reusable buffer the caller only reads; a transport with a shared buffer may hand that out instead."""


@dataclass(frozen=True, slots=True)
class Landed:
    view: torch.Tensor
    landing: Landing

    @property
    def in_place(self) -> bool:
        return self.landing is Landing.TARGET


Land = Callable[[int], Landed]
"""Where bucket k lands on a receiver."""


class TransportOptions(Protocol):
    """A transport's own options: a frozen dataclass, validated when made, carried in the sync header."""

    transport: ClassVar[tuple[str, ...]]
    """The transports that take these options."""

    def resolved(self, world_size: int, src: int) -> TransportOptions:
        """These options completed for a group of ``world_size`` sending from ``src`` (defaults that depend
        on it); ValueError if they do not fit it."""
        ...

    def to_wire(self) -> dict[str, Any]: ...


def _copy_here(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


@dataclass(frozen=True, slots=True)
class Sync:
    """What a transport is told about one sync."""

    sync_id: str
    deadline: Deadline
    options: Any
    """The transport's own options (its ``TransportSpec.options`` type), as the sender announced them."""
    copy: Callable[[torch.Tensor, torch.Tensor], None] = _copy_here
    """``copy(dst, src)``: how a transport copies bulk bytes. The sender and the receiver run it on the copy
    thread they own (one intra-op thread): a copy on the caller's thread uses its intra-op pool, whose idle
    workers then spin and starve the other processes of a small host (measured: shm to two receivers on two
    cores 3x slower)."""


class TxTransport(Protocol):
    """Sender side. Per sync: ``setup``, then for every bucket ``buffer`` (where to pack) and ``post``."""

    def reserve(self, plan: Plan, device: torch.device) -> None:
        """Claim what the sync will need before it is announced; TransportUnavailableError if it cannot."""
        ...

    def setup(self, plan: Plan, device: torch.device, sync: Sync) -> None: ...

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor: ...

    def post(self, k: int, view: torch.Tensor) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class RxTransport(Protocol):
    """Receiver side: ``setup``, then iterate ``buckets`` for (k, view, in_place) as they arrive."""

    scratch_buffers: int
    """How many scratch landings may be in use at once (the receiver's ring of buffers)."""

    def setup(self, plan: Plan, device: torch.device, sync: Sync) -> None: ...

    def buckets(
        self, plan: Plan, land: Land, deadline: Deadline
    ) -> Iterator[tuple[int, torch.Tensor, bool]]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TransportSpec:
    """One transport, as data."""

    name: str
    options: Any
    """Its options class (a :class:`TransportOptions`); ``options()`` gives the defaults."""
    parse: Callable[[Any, int, int], Any]
    """Options from the wire (hostile until checked: ProtocolError for anything malformed)."""
    make_tx: Callable[[StatelessGroup, Any], TxTransport]
    make_rx: Callable[[StatelessGroup, int], RxTransport]
    one_host: bool = False
    """Needs every member on one host."""
    devices: tuple[str, ...] = ()
    """The tensor device types it carries (empty: any)."""
    cut_anywhere: bool = False
    """When every member's tensors lie in the plan's byte layout, it can cut the stream at any size without
    packing, so all members may use the merged plan (fewer, bigger operations)."""


def wire_int(d: Any, key: str, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    """An integer field of a dict that came off the wire, checked."""
    v = d.get(key) if isinstance(d, dict) else None
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"{what} field {key!r} is missing or out of range")
    return v


def unknown(kind: str) -> TransportUnavailableError:
    return TransportUnavailableError(
        f"the sender announced transport {kind!r}, which this version does not know"
    )
