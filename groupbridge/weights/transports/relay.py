"""Chained relay: src -> r1 -> r2 -> ..., each bucket cut into chunks that are forwarded as they arrive.

A star broadcast splits the sender's link among its receivers; in a chain each link carries the bytes once,
so the time to N receivers stays near the time to one (plus one chunk per hop).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from ..._control import Deadline
from ...env import relay_window
from ...stateless import StatelessGroup, Work
from .. import _bytes
from ..plan import Plan
from .base import Land

__all__ = ["DEFAULT_CHUNK_BYTES", "RelayRx", "RelayTx", "default_chain"]

DEFAULT_CHUNK_BYTES = 1 << 20
WINDOW = relay_window()
"""Chunks posted ahead on each link (GROUPBRIDGE_RELAY_WINDOW overrides, for measurements)."""


def default_chain(group: StatelessGroup, src: int) -> list[int]:
    return [src] + [r for r in range(group.world_size) if r != src]


def _chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(nbytes, s + chunk)) for s in range(0, nbytes, chunk)]


def _neighbours(chain: list[int], rank: int) -> tuple[int | None, int | None]:
    i = chain.index(rank)
    return (chain[i - 1] if i > 0 else None), (chain[i + 1] if i + 1 < len(chain) else None)


class RelayTx:
    name = "relay"

    def __init__(self, group: StatelessGroup) -> None:
        self.group = group
        self._buffers = _bytes.BufferCache()
        self._sends: deque[tuple[int, Work]] = deque()  # (bucket, work)
        self._deadline: Deadline | None = None
        self._succ: int | None = None
        self._chunk = DEFAULT_CHUNK_BYTES

    def setup(self, plan: Plan, device: torch.device, options: dict[str, Any]) -> None:
        self._deadline = options["deadline"]
        self._chunk = int(options["chunk_bytes"])
        _, self._succ = _neighbours(list(options["chain"]), self.group.rank)

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        while self._sends and self._sends[0][0] <= k - 2:  # the buffer bucket k reuses must be sent
            self._sends.popleft()[1].wait(self._deadline)
        return self._buffers.get(f"bucket{k % 2}", nbytes, device)

    def post(self, k: int, view: torch.Tensor) -> None:
        if self._succ is None:
            return
        for start, end in _chunks(view.numel(), self._chunk):
            while len(self._sends) >= 2 * WINDOW:
                self._sends.popleft()[1].wait(self._deadline)
            work = self.group.send(view[start:end], self._succ, async_op=True)
            assert work is not None
            self._sends.append((k, work))

    def finish(self) -> None:
        while self._sends:
            self._sends.popleft()[1].wait(self._deadline)

    def close(self) -> None:
        self._sends.clear()
        self._buffers.clear()


class RelayRx:
    def __init__(self, group: StatelessGroup, src: int) -> None:
        self.group = group
        self.src = src
        self._pred: int | None = None
        self._succ: int | None = None
        self._chunk = DEFAULT_CHUNK_BYTES

    def setup(self, plan: Plan, device: torch.device, options: dict[str, Any]) -> None:
        self._chunk = int(options["chunk_bytes"])
        self._pred, self._succ = _neighbours(list(options["chain"]), self.group.rank)

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        assert self._pred is not None
        for k in range(len(plan.buckets)):
            view, kind = land(k)
            chunks = _chunks(view.numel(), self._chunk)
            recvs: deque[tuple[int, int, Work]] = deque()
            sends: list[Work] = []
            for s, e in chunks[:WINDOW]:
                recvs.append((s, e, self._recv(view, s, e)))
            posted = min(WINDOW, len(chunks))
            while recvs:
                s, e, work = recvs.popleft()
                work.wait(deadline)
                if posted < len(chunks):
                    ns, ne = chunks[posted]
                    recvs.append((ns, ne, self._recv(view, ns, ne)))
                    posted += 1
                if self._succ is not None:
                    fwd = self.group.send(view[s:e], self._succ, async_op=True)
                    assert fwd is not None
                    sends.append(fwd)
            for fwd in sends:
                fwd.wait(deadline)
            yield k, view, kind == "target"

    def _recv(self, view: torch.Tensor, start: int, end: int) -> Work:
        assert self._pred is not None
        work = self.group.recv(view[start:end], self._pred, async_op=True)
        assert work is not None
        return work

    def close(self) -> None:
        pass
