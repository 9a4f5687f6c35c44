"""The group's broadcast: one operation per bucket, a few in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from ..._control import Deadline
from ...env import tuning_int
from ...stateless import StatelessGroup, Work
from .. import _bytes
from ..plan import Plan
from .base import Land

__all__ = ["IN_FLIGHT", "BroadcastRx", "BroadcastTx"]

IN_FLIGHT = tuning_int("IN_FLIGHT", 2)
"""Buckets on the wire at once: the next bucket's packing (sender) or unpacking (receiver) overlaps them."""


class BroadcastTx:
    name = "broadcast"

    def __init__(self, group: StatelessGroup) -> None:
        self.group = group
        self._buffers = _bytes.BufferCache()
        self._pending: deque[Work] = deque()
        self._deadline: Deadline | None = None

    def setup(self, plan: Plan, device: torch.device, options: dict[str, Any]) -> None:
        self._deadline = options["deadline"]

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        self._make_room()
        return self._buffers.get(f"bucket{k % IN_FLIGHT}", nbytes, device)

    def _make_room(self) -> None:
        if len(self._pending) >= IN_FLIGHT:
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
    def __init__(self, group: StatelessGroup, src: int) -> None:
        self.group = group
        self.src = src

    def setup(self, plan: Plan, device: torch.device, options: dict[str, Any]) -> None:
        pass

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        n = len(plan.buckets)
        pending: deque[tuple[torch.Tensor, bool, Work]] = deque()

        def post(k: int) -> None:
            view, kind = land(k)
            work = self.group.broadcast(view, src=self.src, async_op=True)
            assert work is not None
            pending.append((view, kind == "target", work))

        for k in range(min(IN_FLIGHT, n)):
            post(k)
        for k in range(n):
            view, in_place, work = pending.popleft()
            work.wait(deadline)
            yield k, view, in_place
            if k + IN_FLIGHT < n:
                post(k + IN_FLIGHT)

    def close(self) -> None:
        pass
