"""The handle of an incoming version (``WeightReceiver.receive()``): iterated once, and a step of the
sync's protocol until it is read to the end, so dropping or closing it unread tells the peers."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator, Iterator

import torch

from ..stateless import StatelessGroup
from ._session import Session


class WeightUpdate:
    """One incoming version; iterate it for (name, tensor) pairs as buckets arrive.

    A yielded tensor is a view into one of the receiver's own buffers (never the sender's memory), valid
    only until the next bucket's tensors are yielded: consume or copy it first (``load_weights`` copies each
    at once). A tensor spanning buckets is yielded as its own copy; tied names follow the tensor they share.
    The receiver's ``version`` moves only once iteration finished and the digests (when on) matched: a
    consumer applying tensors as they come must treat a failure as a torn update. Stopping early (``break``,
    an exception, dropping the iterator) aborts the sync for everyone: the sender cannot finish it.

    With deltas (``WeightSender(delta=True)``) tensors are views of the receiver's kept copy of the version
    (one copy of the model's wire bytes), read-only and valid until the next sync; a delta update (``delta``
    True) yields only the tensors that changed, each whole, so ``load_weights`` touches only them.
    """

    def __init__(
        self, session: Session, pairs: Generator[tuple[str, torch.Tensor], None, None], group: StatelessGroup,
        kept: bool = False, unread: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.version = session.header.version
        self.manifest = session.manifest
        self.delta = session.delta
        """This update travels as a delta against the version held."""
        self.kept = session.header.keeps_base or kept
        """The yielded tensors are views of the receiver's kept copy: valid until the next sync."""
        self._pairs: Generator[tuple[str, torch.Tensor], None, None] | None = pairs
        self._taken: Generator[tuple[str, torch.Tensor], None, None] | None = None
        reason = f"the update of version {self.version} was dropped before it was read"
        self._finalizer = weakref.finalize(self, _abandon, group, reason, unread)
        self._finalizer.atexit = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._pairs is None:
            raise RuntimeError("a WeightUpdate can be iterated once")
        pairs, self._pairs = self._pairs, None
        self._finalizer.detach()  # from now on the iterator tells the peers if it is stopped early
        self._taken = pairs
        return pairs

    def close(self) -> None:
        """Give up this update if not read to the end: the sync is aborted for every member (they raise
        within the liveness bound). Idempotent; a finished update is left as it is."""
        if self._pairs is not None:
            self._pairs = None
            self._finalizer()
        elif self._taken is not None:
            self._taken.close()

    def __enter__(self) -> WeightUpdate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _abandon(group: StatelessGroup, reason: str, unread: Callable[[], None] | None) -> None:
    """An update dropped or closed unread: abort its sync for every member (no-op once the group closed),
    then ``unread`` (the receiver's next receive may begin)."""
    try:
        if not group.closed:
            group.abort(f"rank {group.rank}: {reason}")
    finally:
        if unread is not None:
            unread()
