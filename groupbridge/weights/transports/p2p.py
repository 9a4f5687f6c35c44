"""``p2p``: a stream of buckets over the group's point-to-point send/recv, each bucket to its own receiver.

The transport of a many-source sync's pairs across hosts: a source's stream interleaves its receivers'
buckets (``Sync.to`` names the receiver of each), and each receiver reads only its own. Without ``Sync.to``
(one source to every receiver) each bucket is sent to every receiver in turn: a star, which ``broadcast``
and ``relay`` beat; it is there for completeness. A few buckets are in
flight per source (sends posted asynchronously, receives posted ahead), so packing the next bucket overlaps
the wire. gloo matches a pair's sends and receives in order, so no bucket needs a name on the wire.

Every member walks the buckets of a sync in one global order (round, turn, source: see ``Session.turns``),
and every wait is for an earlier bucket in that order (a source reusing a buffer waits for a send it posted
before; a receiver waits for the bucket it needs next): the streams of many sources to many receivers
cannot wait on each other in a cycle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...control import Deadline
from ...errors import ProtocolError
from ...stateless import StatelessGroup, Work
from ..plan import Plan
from .base import Land, Landing, NoResources, Sync, TransportSpec, wire_int

__all__ = ["SPEC", "P2POptions", "P2PRx", "P2PTx"]


@dataclass(frozen=True, slots=True)
class P2POptions:
    """Options of transport ``p2p``."""

    transport: ClassVar[tuple[str, ...]] = ("p2p",)
    in_flight: int = 2
    """Buckets a source has on the wire at once (each holds a buffer of its own)."""

    def __post_init__(self) -> None:
        if type(self.in_flight) is not int or not 1 <= self.in_flight <= 16:
            raise ValueError(f"in_flight={self.in_flight!r} must be an int in 1..16")

    def resolved(self, world_size: int, src: int) -> P2POptions:
        return self

    def to_wire(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight}

    @classmethod
    def parse(cls, d: Any, world_size: int, src: int) -> P2POptions:
        return cls(wire_int(d, "in_flight", "p2p options", 1, 16))


class P2PTx(NoResources):
    """The source's side: every bucket sent to its receiver, ``in_flight`` at once."""

    def __init__(self, group: StatelessGroup, options: P2POptions) -> None:
        self.group = group
        self.in_flight = options.in_flight
        self._buffers: list[torch.Tensor | None] = [None] * self.in_flight
        self._pending: deque[tuple[int, Work, torch.Tensor]] = deque()
        self._to: tuple[int, ...] | None = None
        self._everyone = [r for r in range(group.world_size) if r != group.rank]
        self._deadline: Deadline | None = None

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        if sync.to is not None and len(sync.to) != len(plan.buckets):
            raise ProtocolError(f"p2p: {len(sync.to)} receivers named for {len(plan.buckets)} buckets")
        self._to = sync.to
        self._deadline = sync.deadline

    def _wait_for(self, k: int) -> None:
        """Wait until the sends posted before bucket ``k - in_flight`` (inclusive) have left."""
        assert self._deadline is not None
        while self._pending and self._pending[0][0] <= k - self.in_flight:
            self._pending.popleft()[1].wait(self._deadline)

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        self._wait_for(k)
        i = k % self.in_flight
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def post(self, k: int, view: torch.Tensor) -> None:
        self._wait_for(k)
        for dst in self._everyone if self._to is None else (self._to[k],):
            work = self.group.send(view, dst, async_op=True)
            assert work is not None
            self._pending.append((k, work, view))  # the view stays alive until its send completed

    def finish(self) -> None:
        assert self._deadline is not None
        while self._pending:
            self._pending.popleft()[1].wait(self._deadline)

    def close(self) -> None:
        self._pending.clear()
        self._buffers = [None] * self.in_flight


class P2PRx:
    """A receiver's side for one source: its buckets received in order, a few posted ahead."""

    def __init__(self, group: StatelessGroup) -> None:
        self.group = group
        self.src = 0
        self.in_flight = 2
        self.scratch_buffers = 3

    def attach(self, offer: dict[str, Any], src: int) -> str | None:
        self.src = src
        return None

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        self.in_flight = sync.options.in_flight
        self.scratch_buffers = self.in_flight + 1  # those posted, and the one the consumer reads

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        n = len(plan.buckets)
        posted: deque[tuple[int, torch.Tensor, bool, Work]] = deque()

        def post(k: int) -> None:
            start, end = plan.bucket_range(k)
            landed = land(k)
            view = landed.view[: end - start]
            work = self.group.recv(view, self.src, async_op=True)
            assert work is not None
            posted.append((k, view, landed.landing is Landing.TARGET, work))

        for k in range(min(self.in_flight, n)):
            post(k)
        while posted:
            k, view, in_place, work = posted.popleft()
            work.wait(deadline)
            if k + self.in_flight < n:
                post(k + self.in_flight)
            yield k, view, in_place

    def close(self) -> None:
        pass


SPEC = TransportSpec("p2p", P2POptions, P2POptions.parse, P2PTx, P2PRx, pairs=True)
