"""What the parts of one group share: who this member is, its store connection, and whether the group
broke or closed; and the group's rank-prefixed log."""

from __future__ import annotations

import logging
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..control import Deadline
from ..errors import GroupClosedError
from ..net import Address
from ..store import StoreClient

__all__ = ["GroupLog", "GroupState"]

if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:  # subscriptable at run time only from Python 3.11
    _Adapter = logging.LoggerAdapter


class GroupLog(_Adapter):
    """One group's logger: every message starts with ``[<name> r<rank>] ``, and its records carry ``group``
    and ``rank`` attributes for handlers that want them."""

    def __init__(self, logger: logging.Logger, name: str, rank: int) -> None:
        super().__init__(logger, {"group": name, "rank": rank})
        self.prefix = f"[{name} r{rank}] "

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        msg, kwargs = super().process(msg, kwargs)
        return f"{self.prefix}{msg}", kwargs


@dataclass(eq=False, kw_only=True)
class GroupState:
    """One member's view of its group, shared by the group's parts.

    Identity and bounds are fixed at creation; ``address`` is final once the join began (rank 0 learns its
    port then); ``client`` is set by the join; ``broken`` and ``closed`` change as the group lives.
    """

    rank: int
    world_size: int
    name: str
    generation: int
    timeout: timedelta
    """The join's bound and every later operation's default bound."""
    liveness_timeout: timedelta
    namespace: str
    """Every key of the group lives under it (name and generation)."""
    address: Address
    """Where rank 0 serves the store."""
    log: GroupLog
    client: StoreClient | None = None
    """The caller's store connection (the watcher has its own); the watcher shuts it down on a finding."""
    pg_client: StoreClient | None = None
    """The process groups' own connection (gloo's rendezvous, a device group's first collective), shut down
    with ``client``. Never used for a queue wait, so torch's server never ends one of its waits early (see
    :mod:`groupbridge.control`: a connection that waited on a queue is woken by later pushes to it), which
    a process group's own ``get`` would take for an empty value."""
    broken: str | None = None
    """Why the group broke (an abort, a peer's failure), once it did; the group is then of no further use."""
    closed: bool = False
    teardown_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the store connections are woken (watcher thread) or closed (teardown)."""

    def where(self) -> str:
        return f"group '{self.name}' (generation {self.generation}) at {self.address}"

    def others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def io_timeout(self) -> timedelta:
        """Bound on one store request's reply (not on a server-side wait)."""
        return max(self.liveness_timeout, timedelta(seconds=1))

    def check_open(self) -> None:
        if self.closed:
            raise GroupClosedError(f"{self.where()} is closed (rank {self.rank})")
        if self.broken is not None:
            raise GroupClosedError(f"{self.where()} is broken and must be made again: {self.broken}")

    def deadline(self, timeout: timedelta | Deadline | None = None) -> Deadline:
        if isinstance(timeout, Deadline):
            return timeout
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        return Deadline(self.timeout if timeout is None else timeout)

    def check_rank(self, rank: int, label: str) -> None:
        """``rank`` (an argument named ``label``) must be a rank of this group."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{label}={rank!r} is not a rank of this group (0..{self.world_size - 1})")

    def check_peer(self, peer: int, label: str) -> None:
        """``peer`` must be a rank of this group other than this member's own."""
        self.check_rank(peer, label)
        if peer == self.rank:
            raise ValueError(f"{label}={peer} is this rank itself")
