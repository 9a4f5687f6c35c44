"""Liveness: every member publishes a heartbeat counter in the group's store and watches everyone else's.

The watching runs on the heartbeat's own thread and connection, not on the caller's: under a saturated
link one store round trip can take as long as a whole bucket of a weight sync, so the data path only reads
what the watcher last saw. A peer whose counter has not moved for ``liveness_timeout`` is declared dead,
long before the group timeout; an ``abort`` key written by a member that failed is seen the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import timedelta

from ._torch_private import Store

__all__ = ["Heartbeat"]


class Heartbeat:
    """One member's heartbeat publisher and watcher of the others (see the module docstring)."""

    def __init__(
        self, store: Store, rank: int, world_size: int, liveness_timeout: timedelta, name: str
    ) -> None:
        self.store = store
        self.rank = rank
        self.limit = liveness_timeout.total_seconds()
        self.interval = max(0.05, self.limit / 5)
        self.peers = [r for r in range(world_size) if r != rank]
        now = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {r: (-1, now) for r in self.peers}
        """Per peer: its last counter and when (this clock) it last changed."""
        self.error: str | None = None
        """Why the store stopped answering the watcher, if it did."""
        self.abort: bytes | None = None
        """The ``abort`` record a failed member published, once seen."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"groupbridge-hb-{name}-{rank}", daemon=True)

    def start(self) -> None:
        self.store.add(f"hb/{self.rank}", 1)
        self._thread.start()

    def _beat(self) -> None:
        key = f"hb/{self.rank}"
        peer_keys = [f"hb/{r}" for r in self.peers]
        while not self._stop.wait(self.interval):
            try:
                self.store.add(key, 1)
                counts = [self.store.add(k, 0) for k in peer_keys]
                aborted = self.store.get("abort") if self.store.check(["abort"]) else None
            except Exception as e:  # the store host is gone: the caller's thread reports it
                self.error = f"{type(e).__name__}: {e}"
                return
            now = time.monotonic()
            for peer, count in zip(self.peers, counts, strict=True):
                if self.seen[peer][0] != count:
                    self.seen[peer] = (count, now)
            if aborted is not None:
                self.abort = aborted

    def stale(self, peers: Iterable[int]) -> tuple[int, float] | None:
        """The first of ``peers`` silent for longer than the liveness timeout, and for how long."""
        now = time.monotonic()
        for peer in peers:
            seen = self.seen.get(peer)
            if peer != self.rank and seen is not None and now - seen[1] > self.limit:
                return peer, now - seen[1]
        return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
