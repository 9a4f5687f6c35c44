"""The group's broadcast: one operation per bucket, a few in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...control import Deadline
from ...env import tuning_int
from ...stateless import StatelessGroup, Work
from .. import _bytes
from ..plan import Plan
from .base import Land, NoResources, Sync, TransportSpec, wire_int

__all__ = ["SPEC", "BroadcastOptions", "BroadcastRx", "BroadcastTx"]

MAX_IN_FLIGHT = 64


@dataclass(frozen=True, slots=True)
class BroadcastOptions:
    """Options of transport ``broadcast``."""

    transport: ClassVar[tuple[str, ...]] = ("broadcast",)
    in_flight: int = field(default_factory=lambda: tuning_int("IN_FLIGHT", 2))
    """Buckets on the wire at once: the next bucket's packing (sender) or unpacking (receiver) overlaps
    them. Default 2 (``GROUPBRIDGE_IN_FLIGHT`` overrides it, for measurements)."""

    def __post_init__(self) -> None:
        if type(self.in_flight) is not int or not 1 <= self.in_flight <= MAX_IN_FLIGHT:
            raise ValueError(f"in_flight={self.in_flight!r} must be an int in 1..{MAX_IN_FLIGHT}")

    def resolved(self, world_size: int, src: int) -> BroadcastOptions:
        return self

    def to_wire(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight}

    @classmethod
    def parse(cls, d: Any, world_size: int, src: int) -> BroadcastOptions:
        return cls(wire_int(d, "in_flight", "broadcast options", 1, MAX_IN_FLIGHT))


class BroadcastTx(NoResources):
    def __init__(self, group: StatelessGroup, options: BroadcastOptions) -> None:
        self.group = group
        self.options = options
        self._buffers = _bytes.BufferCache()
        self._pending: deque[Work] = deque()
        self._deadline: Deadline | None = None

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        self._deadline = sync.deadline

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        self._make_room()
        return self._buffers.get(f"bucket{k % self.options.in_flight}", nbytes, device)

    def _make_room(self) -> None:
        if len(self._pending) >= self.options.in_flight:
            self._pending.popleft().wait(self._deadline)

    def post(self, k: int, view: torch.Tensor) -> None:
        self._make_room()
        work = self.group.broadcast(view, src=self.group.rank, async_op=True)
        assert work is not None
        self._pending.append(work)

    def finish(self) -> None:
        while self._pending:
            self._pending.popleft().wait(self._deadline)

    def close(self) -> None:
        self._pending.clear()
        self._buffers.clear()


class BroadcastRx:
    def __init__(self, group: StatelessGroup) -> None:
        self.group = group
        self.src = 0
        self.scratch_buffers = 2

    def attach(self, offer: dict[str, Any], src: int) -> str | None:
        self.src = src
        return None

    def open(self, plan: Plan, device: torch.device, sync: Sync[BroadcastOptions]) -> None:
        self.scratch_buffers = sync.options.in_flight

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        n = len(plan.buckets)
        pending: deque[tuple[torch.Tensor, bool, Work]] = deque()

        ahead = self.scratch_buffers

        def post(k: int) -> None:
            landed = land(k)
            work = self.group.broadcast(landed.view, src=self.src, async_op=True)
            assert work is not None
            pending.append((landed.view, landed.in_place, work))

        for k in range(min(ahead, n)):
            post(k)
        for k in range(n):
            view, in_place, work = pending.popleft()
            work.wait(deadline)
            yield k, view, in_place
            if k + ahead < n:
                post(k + ahead)

    def close(self) -> None:
        pass


SPEC: TransportSpec[BroadcastOptions] = TransportSpec(
    "broadcast", BroadcastOptions, BroadcastOptions.parse, BroadcastTx, BroadcastRx, cut_anywhere=True
)
