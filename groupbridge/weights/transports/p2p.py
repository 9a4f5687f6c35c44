"""``p2p``: buckets over the group's point-to-point send/recv, each to its own receiver (``Sync.to``).

It carries a many-source sync's pairs across hosts. Without ``Sync.to`` every bucket goes to every receiver
in turn: a star, which ``broadcast`` and ``relay`` beat. ``in_flight`` buckets per source are on the wire
(sends asynchronous, receives posted ahead), so packing the next bucket overlaps the wire; gloo matches a
pair's sends and receives in order, so no bucket needs a name on the wire. No wait can close a cycle: a
source reusing a buffer waits for a send it posted earlier, a receiver for the bucket it needs next, both
earlier in the one order every member walks (``ShardPlan.turn``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...control import Deadline
from ...errors import ProtocolError
from ...stateless import StatelessGroup, Work
from ..plan import Plan
from .base import GroupRx, GroupTx, Land, PlainOptions, Sync, TransportSpec, wire_int

__all__ = ["SPEC", "P2POptions", "P2PRx", "P2PTx"]

MAX_IN_FLIGHT = 16


@dataclass(frozen=True, slots=True)
class P2POptions(PlainOptions):
    """Options of transport ``p2p``."""

    transport: ClassVar[tuple[str, ...]] = ("p2p",)
    in_flight: int = 2
    """Buckets a source has on the wire at once (each holds a buffer of its own)."""

    def __post_init__(self) -> None:
        if type(self.in_flight) is not int or not 1 <= self.in_flight <= MAX_IN_FLIGHT:
            raise ValueError(f"in_flight={self.in_flight!r} must be an int in 1..{MAX_IN_FLIGHT}")

    @classmethod
    def parse(cls, d: Any, world_size: int, src: int) -> P2POptions:
        return cls(wire_int(d, "in_flight", "p2p options", 1, MAX_IN_FLIGHT))


class P2PTx(GroupTx[P2POptions]):
    """The source's side: every bucket sent to its receiver, ``in_flight`` at once."""

    def __init__(self, group: StatelessGroup, options: P2POptions) -> None:
        super().__init__(group, options)
        self._to: tuple[int, ...] | None = None
        self._everyone = [r for r in range(group.world_size) if r != group.rank]

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        if sync.to is not None and len(sync.to) != len(plan.buckets):
            raise ProtocolError(f"p2p: {len(sync.to)} receivers named for {len(plan.buckets)} buckets")
        self._to = sync.to
        super().open(plan, device, sync)

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        self._drain(k - self.options.in_flight)
        return self._buffers.get(f"bucket{k % self.options.in_flight}", nbytes, device)

    def post(self, k: int, view: torch.Tensor) -> None:
        self._drain(k - self.options.in_flight)
        for dst in self._everyone if self._to is None else (self._to[k],):
            self._sent(k, self.group.send(view, dst, async_op=True), view)


class P2PRx(GroupRx):
    """A receiver's side for one source: its buckets received in order, a few posted ahead."""

    def __init__(self, group: StatelessGroup) -> None:
        super().__init__(group)
        self.in_flight = 2
        self.scratch_buffers = 3

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        self.in_flight = sync.options.in_flight
        self.scratch_buffers = self.in_flight + 1  # those posted, and the one the consumer reads

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        def recv(k: int) -> tuple[torch.Tensor, bool, Work | None]:
            start, end = plan.bucket_range(k)
            landed = land(k)
            view = landed.view[: end - start]
            return view, landed.in_place, self.group.recv(view, self.src, async_op=True)

        yield from self._ahead(len(plan.buckets), self.in_flight, recv, deadline, early=True)


SPEC = TransportSpec("p2p", P2POptions, P2POptions.parse, P2PTx, P2PRx, pairs=True)
