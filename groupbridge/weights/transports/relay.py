"""Chained relay: src -> r1 -> r2 -> ..., each bucket cut into chunks forwarded as they arrive. A star
broadcast splits the sender's link among its receivers; in a chain each link carries the bytes once, so the
time to N receivers stays near the time to one (plus one chunk per hop)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from ...control import Deadline
from ...env import tuning_int
from ...errors import ProtocolError
from ...stateless import StatelessGroup, Work
from ..plan import Plan
from .base import GroupRx, GroupTx, Land, Sync, TransportSpec, wire_int

__all__ = ["DEFAULT_CHUNK_BYTES", "SPEC", "RelayOptions", "RelayRx", "RelayTx"]

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_WINDOW = 256


@dataclass(frozen=True, slots=True)
class RelayOptions:
    """Options of transport ``relay``."""

    transport: ClassVar[tuple[str, ...]] = ("relay",)
    chain: tuple[int, ...] | None = None
    """The relay order: ranks starting with the sender, each once (default: the sender, then by rank)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """What each hop forwards at a time: smaller starts the next hop sooner, bigger costs fewer operations."""
    window: int = field(default_factory=lambda: tuning_int("RELAY_WINDOW", 4))
    """Chunks posted ahead per link (``GROUPBRIDGE_RELAY_WINDOW`` sets the default, for measurements)."""

    def __post_init__(self) -> None:
        if self.chain is not None:
            if isinstance(self.chain, (str, bytes)) or not isinstance(self.chain, Sequence):
                raise TypeError(f"chain={self.chain!r} must be a sequence of ranks")
            object.__setattr__(self, "chain", tuple(self.chain))
        if type(self.chunk_bytes) is not int or self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes={self.chunk_bytes!r} must be an int >= 1024")
        if type(self.window) is not int or not 1 <= self.window <= MAX_WINDOW:
            raise ValueError(f"window={self.window!r} must be an int in 1..{MAX_WINDOW}")

    def resolved(self, world_size: int, src: int) -> RelayOptions:
        chain = self.chain or (src, *(r for r in range(world_size) if r != src))
        if sorted(chain) != list(range(world_size)) or chain[0] != src:
            raise ValueError(
                f"chain={list(chain)} must start with the sender ({src}) and name every rank once"
            )
        return replace(self, chain=chain)

    def to_wire(self) -> dict[str, Any]:
        return {"chain": list(self.chain or ()), "chunk_bytes": self.chunk_bytes, "window": self.window}

    @classmethod
    def parse(cls, d: Any, world_size: int, src: int) -> RelayOptions:
        chain = d.get("chain") if isinstance(d, dict) else None
        if not isinstance(chain, list) or not all(type(r) is int for r in chain):
            raise ProtocolError("relay options: 'chain' is not a list of ranks")
        try:
            return cls(
                tuple(chain),
                wire_int(d, "chunk_bytes", "relay options", 1024, 1 << 40),
                wire_int(d, "window", "relay options", 1, MAX_WINDOW),
            ).resolved(world_size, src)
        except ValueError as e:
            raise ProtocolError(f"relay options: {e}") from None


def _chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(nbytes, s + chunk)) for s in range(0, nbytes, chunk)]


def _neighbours(chain: list[int], rank: int) -> tuple[int | None, int | None]:
    i = chain.index(rank)
    return (chain[i - 1] if i > 0 else None), (chain[i + 1] if i + 1 < len(chain) else None)


class RelayTx(GroupTx[RelayOptions]):
    def __init__(self, group: StatelessGroup, options: RelayOptions) -> None:
        super().__init__(group, options)
        self._succ: int | None = None

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        super().open(plan, device, sync)
        _, self._succ = _neighbours(list(self.options.chain or ()), self.group.rank)

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        self._drain(k - 2)  # the buffer bucket k reuses must be sent
        return self._buffers.get(f"bucket{k % 2}", nbytes, device)

    def post(self, k: int, view: torch.Tensor) -> None:
        if self._succ is None:
            return
        for start, end in _chunks(view.numel(), self.options.chunk_bytes):
            while len(self._pending) >= 2 * self.options.window:
                self._pending.popleft()[1].wait(self._deadline)
            self._sent(k, self.group.send(view[start:end], self._succ, async_op=True), view)


class RelayRx(GroupRx):
    """The chain, in the options, says who each receiver takes from (``attach``'s source is not used)."""

    def __init__(self, group: StatelessGroup) -> None:
        super().__init__(group)
        self._pred: int | None = None
        self._succ: int | None = None
        self._chunk = DEFAULT_CHUNK_BYTES
        self._window = 1

    def open(self, plan: Plan, device: torch.device, sync: Sync[RelayOptions]) -> None:
        options = sync.options
        self._chunk, self._window = options.chunk_bytes, options.window
        self._pred, self._succ = _neighbours(list(options.chain or ()), self.group.rank)

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        assert self._pred is not None
        for k in range(len(plan.buckets)):
            landed = land(k)
            view = landed.view
            chunks = _chunks(view.numel(), self._chunk)
            recvs: deque[tuple[int, int, Work]] = deque()
            sends: list[Work] = []
            for s, e in chunks[: self._window]:
                recvs.append((s, e, self._recv(view, s, e)))
            posted = min(self._window, len(chunks))
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
            yield k, view, landed.in_place

    def _recv(self, view: torch.Tensor, start: int, end: int) -> Work:
        assert self._pred is not None
        work = self.group.recv(view[start:end], self._pred, async_op=True)
        assert work is not None
        return work


SPEC: TransportSpec[RelayOptions] = TransportSpec("relay", RelayOptions, RelayOptions.parse, RelayTx, RelayRx)
