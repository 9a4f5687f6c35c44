"""A group's health: the liveness watcher's wiring, this member's published status, and the errors that say
why the group broke (see :mod:`groupbridge._liveness` for what the watcher finds and how)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from .._liveness import Watcher, decode_status, status_key, write_status
from .._seal import Sealer
from .._torch_private import TCPStore
from ..control import Deadline
from ..errors import GroupBridgeError, PeerDiedError, ProtocolError, StoreUnreachableError
from ..store import StoreClient
from .state import GroupState

__all__ = ["Health"]

_FINAL_BEAT = {"aborted": 1 << 60, "closed": 1 << 59}
"""The beat number of a record written outside the watcher's beats: past any beat the watcher reaches."""


class Health:
    """One member's liveness: its watcher (from :meth:`watch` until :meth:`stop`), the status it publishes,
    and what it knows of the peers. Before :meth:`watch` and after :meth:`stop` it sees nothing: every
    check then passes."""

    def __init__(self, state: GroupState) -> None:
        self._state = state
        self.watcher: Watcher | None = None
        self.scope: tuple[int, ...] = ()
        """Ranks every wait depends on besides its own peers (a weight sync's members: one commit needs
        them all, so a wait on one member ends when any other fails)."""

    def watch(
        self,
        client: StoreClient,
        sealer: Sealer,
        collect: Callable[[StoreClient], None] | None,
        sweep: Callable[[StoreClient], None],
    ) -> None:
        """Start the watcher on ``client``, a connection of its own; ``collect`` and ``sweep`` run on its
        thread at every beat (see :class:`~groupbridge._liveness.Watcher`)."""
        s = self._state
        self.watcher = Watcher(
            client, s.namespace, sealer, s.rank, s.world_size, s.liveness_timeout, s.name, s.log, self._wake,
            collect, sweep,
        )  # fmt: skip
        self.watcher.start()

    def stop(self) -> None:
        """Stop the watcher. A final state published while the caller's connection was spent (the watcher
        woke a wait by shutting it down, so :meth:`publish` could not write it) is written now on the
        watcher's own connection: peers then read that this member closed or aborted at once, where rank 0
        closing would otherwise wait out its grace for a record that never comes."""
        w = self.watcher
        if w is None:
            return
        w.stop()
        self.watcher = None
        state, reason = w.published
        client = self._state.client
        if state == "live" or w.running() or client is None or not client.interrupted:
            return
        if w.error is not None or (w.finding is not None and w.finding.kind in ("store", "crashed")):
            return  # the store is what failed, or the watcher's own connection may be spent: nobody to tell
        key = f"{self._state.namespace}/{status_key(self._state.rank)}"
        try:
            store = w.client.get()
            store.set_timeout(self._state.io_timeout())
            write_status(store, key, w.sealer, _FINAL_BEAT[state], state, reason, ack=True)
        except (RuntimeError, GroupBridgeError):  # the store is what failed: nobody is left to read it
            self._state.log.debug("could not publish that this member %s", state, exc_info=True)

    def _wake(self) -> None:
        """Called by the watcher on a finding: wake the caller's wait (its connection is then spent)."""
        s = self._state
        with s.teardown_lock:
            for client in (s.client, s.pg_client):
                if client is not None:
                    client.interrupt()

    @contextlib.contextmanager
    def depending_on(self, ranks: Iterable[int]) -> Iterator[None]:
        """Add ``ranks`` to :attr:`scope` for the block."""
        before = self.scope
        self.scope = tuple(dict.fromkeys((*before, *ranks)))
        try:
            yield
        finally:
            self.scope = before

    def set_awaited(self, peers: Iterable[int]) -> None:
        """The ranks the caller's current wait depends on: the watcher wakes it if one of them fails."""
        if self.watcher is not None:  # cleared after every wait, on the caller's way out: the short way
            self.watcher.awaited = tuple(dict.fromkeys((*peers, *self.scope))) if peers or self.scope else ()

    def grace(self, extra: float) -> timedelta:
        """Two of the watcher's beats and ``extra`` seconds, at most 2 s: long enough for a peer's last
        record to be read, short enough not to matter in a teardown."""
        interval = self.watcher.interval if self.watcher is not None else 0.0
        return timedelta(seconds=min(2 * interval + extra, 2.0))

    def publish(self, state: str, reason: str | None = None, *, now: bool = True) -> None:
        """Publish this member's final ``state`` ("aborted" or "closed"): the watcher's next beats carry it,
        and with ``now`` the record is written at once and acknowledged, so that peers find it even if this
        process exits next. Best effort: the store may be what failed."""
        w, client = self.watcher, self._state.client
        if w is None:
            return
        w.publish(state, reason)
        if not now or client is None or client.interrupted:
            return
        key = f"{self._state.namespace}/{status_key(self._state.rank)}"
        try:
            write_status(client.get(), key, w.sealer, _FINAL_BEAT[state], state, reason, ack=True)
        except (RuntimeError, GroupBridgeError):  # the next beat retries, on the watcher's connection
            self._state.log.debug("could not publish that this member %s", state, exc_info=True)

    def failure(self, peers: Iterable[int] = ()) -> GroupBridgeError | None:
        """The error that describes why the group broke (a watcher's finding, or one of ``peers`` silent or
        closed), or None while it is healthy. Marks the group broken when it finds one."""
        w = self.watcher
        if w is None:
            return None
        finding = w.finding
        if finding is None:
            if w.all_heard():
                return None
            for peer in (*peers, *self.scope):
                finding = w.silent(peer) or w.gone(peer)
                if finding is not None:
                    break
        if finding is None:
            return None
        suspended = (
            f" (this process itself did not run for {w.stopped_for:.1f}s)" if w.stopped_for > w.limit else ""
        )
        s = self._state
        if s.broken is None:
            s.broken = finding.text
        text = f"rank {s.rank} of {s.where()}: {finding.text}{suspended}"
        if finding.kind == "store":
            return StoreUnreachableError(text)
        if finding.kind == "crashed":
            err = GroupBridgeError(f"{text}; the group can no longer see its peers and must be made again")
            err.__cause__ = w.error
            return err
        return PeerDiedError(text, rank=finding.rank, aborted=finding.kind == "aborted")

    def check_peers(self, peers: Iterable[int]) -> None:
        """Raise if a peer aborted, went silent or closed, or the store host is gone (the watcher saw it)."""
        failed = self.failure(peers)
        if failed is not None:
            raise failed

    def errored(self) -> BaseException | None:
        """What ended the watcher's thread, if anything but :meth:`stop` did."""
        w = self.watcher
        return w.error if w is not None else None

    def peer_statuses(self, store: TCPStore | None = None) -> dict[int, dict[str, Any] | None]:
        """Every other member's status record, read now on ``store`` (default: the caller's connection; one
        round trip); a malformed or forged record reads as None. Raises RuntimeError when the store does not
        answer, :class:`StoreUnreachableError` without a usable connection or watcher."""
        s = self._state
        if self.watcher is None:
            raise StoreUnreachableError(f"rank {s.rank}: not watching the group")
        sealer = self.watcher.sealer
        if store is None:
            if s.client is None or s.client.interrupted:
                raise StoreUnreachableError(f"rank {s.rank}: no usable store connection")
            store = s.client.get()
        others = s.others()
        keys = [f"{s.namespace}/{status_key(r)}" for r in others]
        store.set_timeout(s.io_timeout())
        out: dict[int, dict[str, Any] | None] = {}
        for r, key, raw in zip(others, keys, store.multi_get(keys), strict=True):
            try:
                out[r] = decode_status(sealer.open(key, bytes(raw)))
            except ProtocolError:
                out[r] = None
        return out

    def peer_aborted(self) -> GroupBridgeError | None:
        """After a data-plane failure: a peer that published why it aborted (read now, not at the next
        beat), so the error names who gave up and why rather than "connection closed by peer"."""
        if self.watcher is None:
            return None
        try:
            statuses = self.peer_statuses()
        except (RuntimeError, GroupBridgeError):  # torch's store errors, or no usable connection left
            return None
        s = self._state
        for peer, status in statuses.items():
            if status is not None and status["state"] == "aborted":
                if s.broken is None:
                    s.broken = f"rank {peer} aborted: {status['reason']}"
                return PeerDiedError(f"rank {s.rank} of {s.where()}: rank {peer} aborted: {status['reason']}")
        return None

    def await_peers_done(self, deadline: Deadline, store: TCPStore | None = None) -> None:
        """Wait (bounded) until every other member has published that it aborted or closed."""

        def all_done() -> bool | None:
            statuses = self.peer_statuses(store)
            return True if all(st is not None and st["state"] != "live" for st in statuses.values()) else None

        try:
            deadline.poll(all_done, 0.01)
        except (RuntimeError, GroupBridgeError):  # the store or our connection is gone: nobody is left
            return

    def linger(self, server: TCPStore | None, timeout: timedelta | None = None) -> None:
        """Rank 0, the store host, closing (``timeout``) or aborting: keep serving until every other member
        has published that it closed or aborted, so that none loses a message it was about to read or the
        reason of the abort (the store goes with this process, which usually exits next).

        Bounded by ``timeout``, or by a couple of beats once the group is broken. Reads on ``server``, the
        store's own connection: the caller's may already be shut down by the watcher.
        """
        if self.watcher is None or self._state.world_size == 1:
            return
        wait = timeout if timeout is not None and self._state.broken is None else self.grace(0.5)
        self.await_peers_done(Deadline(wait), server)
