"""The transport contract and the sender's choice."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ..._control import Deadline
from ...errors import TransportUnavailableError
from ...stateless import StatelessGroup
from ..plan import Plan

__all__ = ["KINDS", "Land", "RxTransport", "TxTransport", "choose", "make_rx", "make_tx"]

KINDS = ("broadcast", "relay", "shm", "cuda_ipc")

Land = Callable[[int], tuple[torch.Tensor, str]]
"""Where bucket k should land on a receiver: (view, kind), kind one of "target" (the caller's own tensors,
in place), "staging" (an atomic update's staging buffer) or "scratch" (a reusable buffer the caller only
reads from; a transport with its own shared buffer may hand that out instead)."""


class TxTransport(Protocol):
    """Sender side. Per sync: ``setup``, then for every bucket ``buffer`` (where to pack) and ``post``."""

    name: str

    def setup(self, plan: Plan, device: torch.device, options: dict[str, Any]) -> None: ...

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor: ...

    def post(self, k: int, view: torch.Tensor) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class RxTransport(Protocol):
    """Receiver side: ``setup``, then iterate ``buckets`` for (k, view, in_place) as they arrive."""

    def setup(self, plan: Plan, device: torch.device, options: dict[str, Any]) -> None: ...

    def buckets(
        self, plan: Plan, land: Land, deadline: Deadline
    ) -> Iterator[tuple[int, torch.Tensor, bool]]: ...

    def close(self) -> None: ...


def same_host(group: StatelessGroup) -> bool:
    return len(set(group.host_ids)) == 1


def choose(requested: str, group: StatelessGroup, device: torch.device) -> str:
    """The transport for this sync; an explicit one that cannot work here is an error, never a fallback.

    Raises:
        TransportUnavailableError: ``shm`` or ``cuda_ipc`` across hosts, ``cuda_ipc`` for CPU tensors, or
            ``shm`` for device tensors.
    """
    receivers = group.world_size - 1
    local = same_host(group)
    if requested == "auto":
        if local and device.type == "cuda":
            return "cuda_ipc"
        if local and device.type == "cpu":
            return "shm"
        return "broadcast" if receivers <= 2 else "relay"
    hosts = ", ".join(f"rank {r}: {h.split('/')[0]}" for r, h in enumerate(group.host_ids))
    if requested in ("shm", "cuda_ipc") and not local:
        raise TransportUnavailableError(
            f"transport={requested!r} needs every member on one host; members are on {hosts}"
        )
    if requested == "shm" and device.type != "cpu":
        raise TransportUnavailableError(
            f"transport='shm' carries CPU tensors; these are on {device}; use 'cuda_ipc'"
        )
    if requested == "cuda_ipc" and device.type != "cuda":
        raise TransportUnavailableError(
            f"transport='cuda_ipc' carries CUDA tensors; these are on {device}; use 'shm'"
        )
    if requested not in KINDS:
        raise ValueError(f"transport={requested!r} is not one of auto, {', '.join(KINDS)}")
    return requested


def make_tx(kind: str, group: StatelessGroup) -> TxTransport:
    from .broadcast import BroadcastTx
    from .relay import RelayTx
    from .shared import SharedTx

    if kind == "broadcast":
        return BroadcastTx(group)
    if kind == "relay":
        return RelayTx(group)
    return SharedTx(group, kind)


def make_rx(kind: str, group: StatelessGroup, src: int) -> RxTransport:
    from .broadcast import BroadcastRx
    from .relay import RelayRx
    from .shared import SharedRx

    if kind == "broadcast":
        return BroadcastRx(group, src)
    if kind == "relay":
        return RelayRx(group, src)
    if kind in ("shm", "cuda_ipc"):
        return SharedRx(group, src, kind)
    raise TransportUnavailableError(
        f"the sender announced transport {kind!r}, which this version does not know"
    )
