"""What engine adapters share on the trainer side beside the session: the state users read, and the
description of a generator that is handed anew at every sync."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..net import Address
from ..stateless import StatelessGroup
from ..weights.sender import SyncStats, WeightSender
from ._trainer import TrainerSession

__all__ = ["Described", "SessionState"]


class SessionState:
    """An engine adapter's view of its :class:`TrainerSession` (``session``, None on a rank that does not
    send): the state users read, under the same names in every adapter."""

    session: TrainerSession | None

    @property
    def version(self) -> int | None:
        """The last version the engine confirmed serving (rank 0), or this rank sent (other senders)."""
        return self.session.version if self.session is not None else None

    @property
    def last_stats(self) -> SyncStats | None:
        return self.session.last_stats if self.session is not None else None

    @property
    def last_seconds(self) -> dict[str, float]:
        """Wall time of the last send: ``transfer`` (to every worker's acknowledgement), ``commit`` (the
        engine's load of a staged update), ``total``."""
        return self.session.last_seconds if self.session is not None else {}

    @property
    def group(self) -> StatelessGroup | None:
        return self.session.group if self.session is not None else None

    @property
    def sender(self) -> WeightSender | None:
        return self.session.sender if self.session is not None else None

    @property
    def address(self) -> Address | None:
        """The bridge's address (rank 0, once connected): what the other sending ranks dial."""
        return self.session.address if self.session is not None else None


Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Described:
    """The names, shapes and dtypes of a trainer's (name, tensor) iterator, learned on its first send and
    passed as ``specs`` to the next ones, which then stream (each tensor pulled, e.g. gathered, while bytes
    move) instead of being collected first. TRL and verl hand a fresh generator each sync, never its
    description."""

    def __init__(self) -> None:
        self.specs: Specs | None = None

    def pairs(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[Any, Specs | None]:
        """What to send and its specs. The first time, the iterator is collected to describe it, tensors on
        an accelerator copied to host memory as they come: a generator that gathers each tensor (FSDP's
        ``full_tensor()``) never holds the whole model on the device."""
        if self.specs is not None:
            return iter(weights), self.specs
        pairs = [(n, t if t.device.type == "cpu" else t.detach().to("cpu")) for n, t in weights]
        return pairs, None

    def sent(self, pairs: Any) -> None:
        """After a send that went through: remember what it described (a failed one is described again)."""
        if self.specs is None and isinstance(pairs, list):
            self.specs = {n: (tuple(t.shape), t.dtype) for n, t in pairs}

    def forget(self) -> None:
        self.specs = None
