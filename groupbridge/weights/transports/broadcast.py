"""The group's broadcast: one operation per bucket, a few in flight."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...control import Deadline
from ...env import tuning_int
from ...stateless import Work
from ..plan import Plan
from .base import GroupRx, GroupTx, Land, PlainOptions, Sync, TransportSpec, wire_int

__all__ = ["SPEC", "BroadcastOptions", "BroadcastRx", "BroadcastTx"]

MAX_IN_FLIGHT = 64


@dataclass(frozen=True, slots=True)
class BroadcastOptions(PlainOptions):
    """Options of transport ``broadcast``."""

    transport: ClassVar[tuple[str, ...]] = ("broadcast",)
    in_flight: int = field(default_factory=lambda: tuning_int("IN_FLIGHT", 2))
    """Buckets on the wire at once: the next bucket's packing (sender) or unpacking (receiver) overlaps
    them. Default 2 (``GROUPBRIDGE_IN_FLIGHT`` overrides it, for measurements)."""

    def __post_init__(self) -> None:
        if type(self.in_flight) is not int or not 1 <= self.in_flight <= MAX_IN_FLIGHT:
            raise ValueError(f"in_flight={self.in_flight!r} must be an int in 1..{MAX_IN_FLIGHT}")

    @classmethod
    def parse(cls, d: Any, world_size: int, src: int) -> BroadcastOptions:
        return cls(wire_int(d, "in_flight", "broadcast options", 1, MAX_IN_FLIGHT))


class BroadcastTx(GroupTx[BroadcastOptions]):
    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        self._drain(k - self.options.in_flight)
        return self._buffers.get(f"bucket{k % self.options.in_flight}", nbytes, device)

    def post(self, k: int, view: torch.Tensor) -> None:
        self._drain(k - self.options.in_flight)
        self._sent(k, self.group.broadcast(view, src=self.group.rank, async_op=True), view)


class BroadcastRx(GroupRx):
    def open(self, plan: Plan, device: torch.device, sync: Sync[BroadcastOptions]) -> None:
        self.scratch_buffers = sync.options.in_flight

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        def recv(k: int) -> tuple[torch.Tensor, bool, Work | None]:
            landed = land(k)
            work = self.group.broadcast(landed.view, src=self.src, async_op=True)
            return landed.view, landed.in_place, work

        yield from self._ahead(len(plan.buckets), self.scratch_buffers, recv, deadline, early=False)


SPEC: TransportSpec[BroadcastOptions] = TransportSpec(
    "broadcast", BroadcastOptions, BroadcastOptions.parse, BroadcastTx, BroadcastRx, cut_anywhere=True
)
