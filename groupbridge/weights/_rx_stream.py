"""What a receiver's receives share, whatever their plan: its transports (:class:`RxStreams`: which one
carries each feeder's stream, attached in the handshake), what a receive borrows from it and its commit
(:class:`Taker`), and how a failure is told to the peers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch

from ..control import Deadline
from ..errors import GroupBridgeError, WeightSyncError
from ..stateless import StatelessGroup
from . import _bytes
from ._copier import Copier
from ._header import Header
from ._session import Session, acknowledge
from ._sharded_delta import DeltaMemory
from .plan import Plans
from .transports import RxTransport, Sync, spec

T = TypeVar("T")


KEPT = "kept"
"""The receiver's one kept buffer (in its ``BufferCache``), whatever the plan: where an atomic receive stages,
where a delta is applied (the version held, when the receiver's store of bases says so) and what
``receive(keep=True)`` yields views of. Each sync lays it out as its plan does; a delta is applied to it only
after a sync of the same plan that left it holding the base (``Bases``, under ``FANOUT``)."""


class RxStreams:
    """A receiver's transports, one per kind and feeder, kept across syncs."""

    def __init__(self, group: StatelessGroup, copier: Copier) -> None:
        self.group = group
        self.copier = copier
        self._transports: dict[tuple[str, int], RxTransport] = {}

    def _carrier(self, feeder: int, session: Session) -> tuple[str, Header | None]:
        """The transport that carries ``feeder``'s stream to this receiver, and the header that announced it:
        a fan-out stream's, the one its source names; a source's pairs, see ``pair_transport``; a receiver
        forwarding pairs (no header), ``p2p`` with its defaults."""
        header = session.headers.get(feeder)
        if header is None:
            return "p2p", None
        return session.topology.carrier(header.transport), header

    def attach(self, src: int, session: Session) -> str | None:
        """In the handshake: attach to what carries this feeder's stream; why not, if this receiver cannot."""
        kind, header = self._carrier(src, session)
        offer = dict(header.offer) if header is not None and kind == header.transport else {}
        rx = self._transports.get((kind, src))
        if rx is None:
            rx = self._transports[(kind, src)] = spec(kind).make_rx(self.group)
        return rx.attach(offer, src)

    def stream(self, feeder: int, session: Session, deadline: Deadline) -> tuple[str, RxTransport, Sync[Any]]:
        """The transport of ``feeder``'s stream (attached in the handshake), its kind, and what it is told:
        the options its source announced (checked here) where the source names it, else its defaults."""
        kind, header = self._carrier(feeder, session)
        options = (
            spec(kind).parse(header.transport_options, self.group.world_size, feeder)
            if header is not None and kind == header.transport
            else spec(kind).options()
        )
        sync_id = (header or session.header).sync_id
        return kind, self._transports[(kind, feeder)], Sync(sync_id, deadline, options, self.copier.copy)

    def close(self) -> None:
        for rx in self._transports.values():
            rx.close()
        self._transports.clear()


@dataclass(frozen=True, slots=True)
class Taker:
    """What a receiver lends its part of a sync, one source's or many: its group, transports, copy thread,
    buffers (kept across syncs), delta bases, names, the version it holds, and what it does once the sync
    commits."""

    group: StatelessGroup
    streams: RxStreams
    copier: Copier
    buffers: _bytes.BufferCache
    memory: DeltaMemory
    """The bases deltas are applied to, one per stream's cut (``memory.bases``)."""
    plans: Plans
    rename: Callable[[str], str]
    held: int | None
    """The version held before this sync."""
    committed: Callable[[int], None]
    """Called once the vote passed and the version is applied, before the sources are acknowledged."""
    device: torch.device
    ready: Callable[[], None] | None = None
    """What the consumer does with the version before the sources are acknowledged (``receive(ready=)``)."""

    def commit(self, version: int, sources: Iterable[int]) -> None:
        """Once the vote passed and what was received is applied: the version held moves, the consumer's
        ``ready`` runs, every source is acknowledged. A ``ready`` that raises fails the sync (no source's
        ``send`` returns, so no commit follows anywhere); an acknowledgement that cannot be sent fails this
        receive and that source's sync (it cannot know this receiver holds the version)."""
        group = self.group
        self.committed(version)
        try:
            if self.ready is not None:
                self.ready()
        except BaseException as e:
            give_up(group, e, f"preparing version {version}", WeightSyncError(
                f"rank {group.rank} holds version {version}, but preparing it failed: {type(e).__name__}: "
                f"{e}; the sender fails this sync"
            ))  # fmt: skip
        to = sorted(sources)
        try:
            acknowledge(group, to, {"ok": True, "error": None})
        except GroupBridgeError as e:
            who = f"rank {to[0]}" if len(to) == 1 else f"ranks {', '.join(map(str, to))}"
            raise WeightSyncError(
                f"rank {group.rank} holds version {version}, but could not acknowledge it to the sender(s) "
                f"({who}): {e}; the sender fails this sync"
            ) from e


def tell_failure(group: StatelessGroup, e: BaseException, what: str) -> None:
    """Tell the peers this side cannot finish the sync: the group is aborted with the reason, so every
    member raises within the liveness bound. (Bytes that fail their digests are not told here: they are
    this receiver's vote, and every member then refuses the sync alike, the group usable.)"""
    group.abort(f"rank {group.rank} gave up {what}: {type(e).__name__}: {e}")


def allocated(group: StatelessGroup, what: str, make: Callable[[], T]) -> T:
    """``make()``: the buffers a sync needs on this receiver. A failure (out of memory, an address-space
    limit) is told to the peers as any other (they raise within the liveness bound, naming this rank) and
    raised here as a :class:`WeightSyncError`."""
    try:
        return make()
    except BaseException as e:
        error = WeightSyncError(
            f"rank {group.rank} could not allocate what {what} needs: {type(e).__name__}: {e}; nothing was "
            "applied"
        )
        give_up(group, e, what, error)


def give_up(
    group: StatelessGroup, cause: BaseException, what: str, error: Exception, tell: bool = True
) -> NoReturn:
    """Tell the peers ``what`` failed (see :func:`tell_failure`; not when ``tell`` is False), then raise
    ``error`` from ``cause``; an interrupt (a BaseException that is not an Exception) propagates unchanged."""
    if tell:
        tell_failure(group, cause, what)
    try:
        if not isinstance(cause, Exception):
            raise cause
        raise error from cause
    finally:  # this frame must not hold what it raised: a cycle would keep the sync's buffers (shared
        del cause, error  # slots among them) mapped until the cycle collector runs
