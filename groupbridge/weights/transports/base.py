"""The transport contract: the calls each side gets and what it may rely on (:class:`TxTransport`,
:class:`RxTransport`), what it is told (:class:`Sync`), what it says of itself (:class:`TransportSpec`)."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import Field, dataclass, fields
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from ...control import Deadline
from ...errors import ProtocolError
from ...stateless import StatelessGroup, Work
from .._bytes import BufferCache
from ..plan import Plan

__all__ = [
    "GroupRx",
    "GroupTx",
    "Land",
    "Landed",
    "Landing",
    "NoResources",
    "PlainOptions",
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
    """A buffer the caller keeps or hands on (an atomic update's staging, ``receive()``'s ring)."""
    SCRATCH = "scratch"
    """A reusable buffer the caller only reads: a transport with a shared buffer may hand that out instead."""


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
        """These options completed for a group of ``world_size`` sending from ``src``; ValueError if unfit."""
        ...

    def to_wire(self) -> dict[str, Any]:
        """These options for the sync's header (JSON-like); :attr:`TransportSpec.parse` reads them back."""
        ...


_Self = TypeVar("_Self")


class PlainOptions:
    """For options whose defaults need nothing of the group and that go on the wire field by field."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    def resolved(self: _Self, world_size: int, src: int) -> _Self:
        return self

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _copy_here(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


OptionsT = TypeVar("OptionsT", bound=TransportOptions)


@dataclass(frozen=True, slots=True)
class Sync(Generic[OptionsT]):
    """What a transport is told each time it is opened for a stream of a sync."""

    sync_id: str
    deadline: Deadline
    options: OptionsT
    """The transport's own options, as the source announced them."""
    copy: Callable[[torch.Tensor, torch.Tensor], None] = _copy_here
    """``copy(dst, src)``: how a transport copies bulk bytes, on the sender's or receiver's own copy thread
    (one intra-op thread): the caller's intra-op pool has idle workers spin and starve the other processes
    of a small host (measured: shm to two receivers on two cores 3x slower)."""
    part: int = 0
    """Which part of this sync's streams (see ``_streams.parts_of``): a fan-out delta opens the transport
    once per group of buckets that has changed ones, numbered by the group."""
    to: tuple[int, ...] | None = None
    """A many-source sync's receiver of each bucket (a source's stream interleaves its pairs; a receiver opens
    its pair's own plan, with its own rank for every bucket); None: every receiver reads every bucket."""

    @property
    def key(self) -> str:
        """The prefix of every control key this opening may use (``wx/<sync id>/<part>``): never reused, so
        that a signal sealed for one sync or part cannot pass for another's."""
        return f"wx/{self.sync_id}/{self.part}"


class TxTransport(Protocol):
    """The source's side of a transport. The calls, in order:

    - ``reserve(plan, device)`` before every sync is announced (cheap when what it holds fits): claim what
      it needs (shared slots), so that a host short of memory is found while another transport can still be
      chosen; if it cannot, it raises :class:`TransportUnavailableError` and holds nothing.
    - ``offer()`` then goes into the sync's header: what receivers need to attach (JSON-like, small, sealed
      with the group's token). Called every sync: a receiver new to the group attaches from it.
    - ``open(plan, device, sync)`` starts a stream of buckets, with no round trip to the receivers. Within one
      sync it may be called again after ``finish()`` with another plan and a higher ``sync.part`` (a fan-out
      delta sends each group of buckets by its own plan). With ``sync.to``, bucket k goes to receiver
      ``sync.to[k]`` alone, and every wait of the transport must be for an earlier bucket of the source's
      stream: many streams run at once, walked by every member in one order (``ShardPlan.turn``).
    - for every bucket k in order: ``buffer(k, nbytes, device)`` where the source may pack it (it blocks
      until that buffer is free again: this is the back-pressure of the pipeline), then ``post(k, view)``.
      ``view`` need not come from ``buffer()``: a bucket laid out in the tensors' own storage, a kept base or
      a delta payload is posted from where it lies, and the transport copies it if it must.
    - ``finish()`` returns once every posted byte has left this process's hands (the receivers may still be
      reading shared memory: the next ``open`` or ``buffer`` waits for them).
    - ``close()`` releases everything; the transport is not used again.

    Raises on the data path: a :class:`groupbridge.GroupBridgeError` (peer died, timed out at
    ``sync.deadline``); the sender then aborts the group.
    """

    def reserve(self, plan: Plan, device: torch.device) -> None: ...

    def offer(self) -> dict[str, Any]: ...

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None: ...

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor: ...

    def post(self, k: int, view: torch.Tensor) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class RxTransport(Protocol):
    """A receiver's side of a transport. The calls, in order:

    - ``attach(offer, src)`` during the handshake, with the source's offer as it came off the wire (hostile
      until checked): map or check what the sync needs; returns why this receiver cannot (every member then
      raises :class:`TransportUnavailableError` before any byte moves), or None. No round trips.
    - ``open(plan, device, sync)`` per stream, as on the source (again per group of a delta sync); after it,
      ``scratch_buffers`` says how many scratch landings may be in use at once (the receiver's ring).
    - ``buckets(plan, land, deadline)`` yields ``(k, view, in_place)`` for every bucket in order, as it
      arrives; ``land(k)`` says where bucket k should land (:class:`Landed`; ``in_place``: a TARGET one).
      A transport with a buffer of its own (a shared slot) may yield that buffer instead of copying into a
      SCRATCH landing: the view is then valid only until the next bucket is asked for.
    - ``close()`` releases mappings and buffers.
    """

    scratch_buffers: int

    def attach(self, offer: dict[str, Any], src: int) -> str | None: ...

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None: ...

    def buckets(
        self, plan: Plan, land: Land, deadline: Deadline
    ) -> Iterator[tuple[int, torch.Tensor, bool]]: ...

    def close(self) -> None: ...


class NoResources:
    """For a source's transport that holds nothing between syncs: nothing to reserve, nothing to offer."""

    def reserve(self, plan: Plan, device: torch.device) -> None:
        """Nothing to claim: the group's own operations carry the bytes."""

    def offer(self) -> dict[str, Any]:
        return {}


class GroupTx(NoResources, Generic[OptionsT]):
    """A source's side over the group's own operations: buffers kept between syncs, views kept until sent."""

    def __init__(self, group: StatelessGroup, options: OptionsT) -> None:
        self.group = group
        self.options = options
        self._buffers = BufferCache()
        self._pending: deque[tuple[int, Work, torch.Tensor]] = deque()
        self._deadline: Deadline | None = None

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        self._deadline = sync.deadline

    def _sent(self, k: int, work: Work | None, view: torch.Tensor) -> None:
        assert work is not None
        self._pending.append((k, work, view))

    def _drain(self, upto: int) -> None:
        """Wait for every send of a bucket up to ``upto``."""
        while self._pending and self._pending[0][0] <= upto:
            self._pending.popleft()[1].wait(self._deadline)

    def finish(self) -> None:
        while self._pending:
            self._pending.popleft()[1].wait(self._deadline)

    def close(self) -> None:
        self._pending.clear()
        self._buffers.clear()


class GroupRx:
    """A receiver's side over the group's own operations: nothing to map; ``attach`` notes the source."""

    def __init__(self, group: StatelessGroup) -> None:
        self.group = group
        self.src = 0
        self.scratch_buffers = 2

    def attach(self, offer: dict[str, Any], src: int) -> str | None:
        self.src = src
        return None

    def _ahead(
        self, n: int, ahead: int, recv: Callable[[int], tuple[torch.Tensor, bool, Work | None]],
        deadline: Deadline, *, early: bool,
    ) -> Iterator[tuple[int, torch.Tensor, bool]]:  # fmt: skip
        """Buckets ``0..n-1`` as they arrive; ``recv(k)`` posts bucket k's receive (its view, whether in
        place, its work) ``ahead`` buckets early: before bucket ``k - ahead`` is yielded if ``early``, after
        it otherwise."""
        posted = deque(recv(k) for k in range(min(ahead, n)))
        for k in range(n):
            view, in_place, work = posted.popleft()
            assert work is not None
            work.wait(deadline)
            if early and k + ahead < n:
                posted.append(recv(k + ahead))
            yield k, view, in_place
            if not early and k + ahead < n:
                posted.append(recv(k + ahead))

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class TransportSpec(Generic[OptionsT]):
    """One transport as data: the sender, handshake and receiver read it and never name a transport."""

    name: str
    options: type[OptionsT]
    """Its options class; ``options()`` gives the defaults."""
    parse: Callable[[Any, int, int], OptionsT]
    """``parse(d, world_size, src)``: options off the wire, checked as hostile (ProtocolError)."""
    make_tx: Callable[[StatelessGroup, OptionsT], TxTransport]
    make_rx: Callable[[StatelessGroup], RxTransport]
    one_host: bool = False
    """Needs every member on one host."""
    devices: tuple[str, ...] = ()
    """The tensor device types it carries (empty: any)."""
    cut_anywhere: bool = False
    """When every member's tensors lie in the plan's byte layout, it can cut the stream at any size without
    packing, so all members may use the merged plan (fewer, bigger operations)."""
    pairs: bool = False
    """It carries a many-source sync's pairs (``Sync.to``); else they go over ``p2p`` (``pair_transport``)."""


def wire_int(d: Any, key: str, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    """An integer field of a dict that came off the wire, checked."""
    v = d.get(key) if isinstance(d, dict) else None
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"{what} field {key!r} is missing or out of range")
    return v
