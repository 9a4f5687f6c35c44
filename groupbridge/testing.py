"""Faults from outside: this process's transports wrapped so that a test (yours or ours) can corrupt, delay or
kill a sync at a chosen bucket without a hook inside the library's hot loops.

Usage, in the process that should misbehave (each rank is its own process)::

    with groupbridge.testing.inject_faults() as faults:
        sender = gb.WeightSender(group)       # made inside the block: its transports are wrapped
        sender.send(model, version=1)          # runs clean
        faults.post = lambda k, view: view[:16].zero_() if k == 1 else None
        sender.send(model, version=2)          # bucket 1 leaves corrupted, after its digest was taken

``post(k, view)`` sees every bucket a source posts (``k`` counts within one opening of the transport: a
delta sync opens it once per group of buckets), after the bucket's digest was taken and before the transport
has it. ``land(k, view)`` sees every bucket a receiver gets, before the receiver checks or applies it. With a
transport whose buffers are shared (``shm``), the receiver's ``view`` is the slot every receiver reads.

Transports are wrapped when they are made: a sender or receiver made before the block keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from .control import Deadline
from .stateless import StatelessGroup
from .weights.plan import Plan
from .weights.transports import TRANSPORTS, Land, RxTransport, Sync, TxTransport

__all__ = ["Faults", "inject_faults"]

Hook = Callable[[int, torch.Tensor], None]


@dataclass
class Faults:
    """What this process's wrapped transports do to the buckets; None: nothing. Set them at any time."""

    post: Hook | None = None
    """``post(k, view)``: a source's bucket k, just before it is posted."""
    land: Hook | None = None
    """``land(k, view)``: a receiver's bucket k, as the transport yields it."""


class _Tx:
    def __init__(self, inner: TxTransport, faults: Faults) -> None:
        self._inner, self._faults = inner, faults

    def reserve(self, plan: Plan, device: torch.device) -> None:
        self._inner.reserve(plan, device)

    def offer(self) -> dict[str, Any]:
        return self._inner.offer()

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        self._inner.open(plan, device, sync)

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        return self._inner.buffer(k, nbytes, device)

    def post(self, k: int, view: torch.Tensor) -> None:
        if self._faults.post is not None:
            self._faults.post(k, view)
        self._inner.post(k, view)

    def finish(self) -> None:
        self._inner.finish()

    def close(self) -> None:
        self._inner.close()


class _Rx:
    def __init__(self, inner: RxTransport, faults: Faults) -> None:
        self._inner, self._faults = inner, faults

    @property
    def scratch_buffers(self) -> int:
        return self._inner.scratch_buffers

    @scratch_buffers.setter
    def scratch_buffers(self, n: int) -> None:
        self._inner.scratch_buffers = n

    def attach(self, offer: dict[str, Any], src: int) -> str | None:
        return self._inner.attach(offer, src)

    def open(self, plan: Plan, device: torch.device, sync: Sync[Any]) -> None:
        self._inner.open(plan, device, sync)

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        for k, view, in_place in self._inner.buckets(plan, land, deadline):
            if self._faults.land is not None:
                self._faults.land(k, view)
            yield k, view, in_place

    def close(self) -> None:
        self._inner.close()


@contextmanager
def inject_faults() -> Iterator[Faults]:
    """Wrap every transport this process makes inside the block; yields the :class:`Faults` they obey."""
    faults = Faults()
    saved = dict(TRANSPORTS)

    def tx(make: Callable[..., TxTransport]) -> Callable[[StatelessGroup, Any], TxTransport]:
        return lambda group, options: _Tx(make(group, options), faults)

    def rx(make: Callable[..., RxTransport]) -> Callable[[StatelessGroup], RxTransport]:
        return lambda group: _Rx(make(group), faults)

    for name, spec in saved.items():
        TRANSPORTS[name] = replace(spec, make_tx=tx(spec.make_tx), make_rx=rx(spec.make_rx))
    try:
        yield faults
    finally:
        TRANSPORTS.update(saved)
