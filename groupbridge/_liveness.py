"""Liveness: every member publishes a status record (a beat counter, its state) and watches the others'.

The watching runs on the watcher's own thread and store connection, never on the caller's: under a saturated
link one store round trip can take as long as a bucket of a weight sync, so the data path only reads what the
watcher last saw. Three findings break the group, each stated with who and when:

- a peer published ``aborted`` (it failed and says why);
- a peer's counter has not moved for ``liveness_timeout`` while this watcher kept polling (dead or frozen);
- the store did not answer for ``liveness_timeout`` (its host is dead, frozen or cut off).

A gap in this watcher's own polling longer than the timeout means *this* process was stopped: it then
restarts its clocks instead of blaming healthy peers. On a finding that concerns a wait in progress, the
watcher shuts the caller's store connection down so that the wait returns at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._seal import ForgedMessageError, Sealer
from ._torch_private import Store
from .errors import GroupBridgeError
from .store import StoreClient

__all__ = ["Finding", "Watcher", "decode_status", "encode_status", "status_key", "write_status"]


def status_key(rank: int) -> str:
    return f"st/{rank}"


class Finding:
    """What broke the group: ``kind`` is "aborted", "silent", "closed", "store" or "crashed" (the watcher
    itself failed); ``rank`` whom it concerns."""

    __slots__ = ("kind", "rank", "text")

    def __init__(self, kind: str, rank: int, text: str) -> None:
        self.kind = kind
        self.rank = rank
        self.text = text


def encode_status(beat: int, state: str, reason: str | None = None) -> bytes:
    return json.dumps({"n": beat, "state": state, "reason": reason}).encode()


def write_status(
    store: Store,
    key: str,
    sealer: Sealer,
    beat: int,
    state: str,
    reason: str | None = None,
    *,
    ack: bool = False,
) -> None:
    """Write a member's status record at ``key`` (its :func:`status_key` in the group's namespace), sealed.

    Every status record is written here: the join's first (beat 0), the watcher's beats, and the final
    record of an abort or a close. With ``ack``, return only once the store has applied it (TCPStore's
    ``set`` is not acknowledged; a ``check`` on the same connection is answered after it).
    """
    store.set(key, sealer.seal(key, encode_status(beat, state, reason)))  # type: ignore[arg-type]
    if ack:
        store.check([key])


def decode_status(raw: bytes) -> dict[str, Any] | None:
    """A peer's status record, or None when it is malformed (hostile or torn: treated as no news)."""
    if len(raw) > 65536:
        return None
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if (
        not isinstance(d, dict)
        or type(d.get("n")) is not int
        or d.get("state") not in ("live", "aborted", "closed")
        or not isinstance(d.get("reason"), (str, type(None)))
    ):
        return None
    return d


class Watcher:
    """One member's status publisher and watcher of the others (see the module docstring)."""

    def __init__(
        self,
        client: StoreClient,
        prefix: str,
        sealer: Sealer,
        rank: int,
        world_size: int,
        liveness_timeout: timedelta,
        name: str,
        log: logging.LoggerAdapter[logging.Logger],
        wake: Callable[[], None],
        collect: Callable[[StoreClient], None] | None = None,
        sweep: Callable[[StoreClient], None] | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.sealer = sealer
        self.rank = rank
        self.limit = liveness_timeout.total_seconds()
        self.interval = max(0.05, self.limit / 5)
        self.peers = [r for r in range(world_size) if r != rank]
        self._log = log
        self._wake = wake
        self._collect = collect
        self._sweep = sweep
        now = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {r: (-1, now) for r in self.peers}
        """Per peer: its last counter and when (this clock) it last changed."""
        self.oldest = now
        """The earliest of the peers' last changes (``seen``), as of the last poll."""
        self.closed: dict[int, str | None] = {}
        """Peers that closed the group, with why it was broken when they did (None: it was not)."""
        self.replayed: dict[int, tuple[int, int]] = {}
        """Peers whose record went back to an older beat (newest seen, older read): someone without the
        token writes recorded records over theirs. Those are never taken for life."""
        self.finding: Finding | None = None
        self.error: BaseException | None = None
        """What ended this watcher's thread, if anything but :meth:`stop` did."""
        self.stopped_for = 0.0
        """The longest gap in this watcher's own polling (this process stopped), in seconds."""
        self.awaited: tuple[int, ...] = ()
        """Ranks the caller's current wait depends on (set by the caller)."""
        self._beat = 0
        self._state: tuple[str, str | None] = ("live", None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"groupbridge-live-{name}-{rank}", daemon=True)
        self._last_ok = now

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{status_key(rank)}"

    def start(self) -> None:
        self._thread.start()

    def publish(self, state: str, reason: str | None = None) -> None:
        """Change this member's published state; the next beat carries it."""
        self._state = (state, reason)

    @property
    def published(self) -> tuple[str, str | None]:
        """This member's published state and why (``("live", None)`` until :meth:`publish`)."""
        return self._state

    def running(self) -> bool:
        """Whether the watcher's thread still runs (its connection is then its own)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        """The watcher's loop; whatever ends it other than :meth:`stop` is a finding, never a silent exit."""
        try:
            self._loop()
        except BaseException as e:  # recorded and reported on the next call on the group (errored())
            if self._stop.is_set():
                return
            finding = Finding(
                "crashed", self.rank, f"rank {self.rank}'s liveness watcher failed: {type(e).__name__}: {e}"
            )
            # The error and the finding together, the log after: whoever sees errored() set finds the
            # finding too, so the next call on the group raises (logging the traceback takes a while).
            self.error = e
            self._found(finding)
            self._log.error("the liveness watcher failed", exc_info=True)

    def _loop(self) -> None:
        store = self.client.get()
        keys = [self._key(r) for r in self.peers]
        mine = self._key(self.rank)
        while True:
            asleep = time.monotonic()
            if self._stop.wait(self.interval):
                return
            late = time.monotonic() - asleep - self.interval
            if late > self.limit:  # this process did not run (SIGSTOP, a VM pause): blame nobody for it
                self.stopped_for = max(self.stopped_for, late)
                now = time.monotonic()
                self.seen = {r: (n, now) for r, (n, _) in self.seen.items()}
                self._last_ok = now
            self._beat += 1
            state, reason = self._state
            try:
                write_status(store, mine, self.sealer, self._beat, state, reason)
                raws = store.multi_get(keys) if keys else []
                if self._collect is not None:
                    self._collect(self.client)
                if self._sweep is not None:
                    self._sweep(self.client)
            except (RuntimeError, OSError, GroupBridgeError) as e:  # torch's store errors, a closed client
                if self._stop.is_set():
                    return
                silent = time.monotonic() - self._last_ok
                self._found(
                    Finding(
                        "store", 0,
                        f"the store at {self.client.address} (hosted by rank 0) did not answer rank "
                        f"{self.rank}'s liveness check; last answer {silent:.1f}s ago ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})",
                    )
                )  # fmt: skip
                return
            now = time.monotonic()
            gap = now - self._last_ok
            self._last_ok = now
            if gap > self.limit:  # this process did not run: restart the clocks, blame nobody
                self.stopped_for = max(self.stopped_for, gap)
                self.seen = {r: (n, now) for r, (n, _) in self.seen.items()}
            for peer, key, raw in zip(self.peers, keys, raws, strict=True):
                try:
                    status = decode_status(self.sealer.open(key, bytes(raw)))
                except ForgedMessageError:
                    status = None
                if status is None:
                    continue
                if status["state"] == "aborted" and self.finding is None:
                    self._found(Finding("aborted", peer, f"rank {peer} aborted: {status['reason']}"))
                if status["state"] == "closed":
                    self.closed[peer] = status.get("reason")
                if status["n"] > self.seen[peer][0]:  # only a newer beat is life
                    self.seen[peer] = (status["n"], now)
                elif status["n"] < self.seen[peer][0]:  # sealed but older: a replay of its own record
                    self.replayed[peer] = (self.seen[peer][0], status["n"])
            self.oldest = min((t for _, t in self.seen.values()), default=now)
            for peer in self.awaited:
                failed = self.silent(peer) or self.gone(peer)
                if failed is not None and self.finding is None:
                    self._found(failed)

    def all_heard(self) -> bool:
        """No peer closed the group, and none was silent past the limit at the last poll: :meth:`silent` and
        :meth:`gone` find nothing for any peer (one look, where asking each peer costs a look per peer on
        every store call of a group of hundreds)."""
        return not self.closed and self._last_ok - self.oldest <= self.limit

    def silent(self, peer: int) -> Finding | None:
        """``peer``'s silence as this watcher *observed* it: from the peer's last change to this watcher's
        last successful poll, not to now. If this process was stopped, its last poll predates the stop,
        so nobody is blamed for it before the watcher has run again (and restarted its clocks)."""
        seen = self.seen.get(peer)
        if seen is None or peer in self.closed:
            return None
        quiet = self._last_ok - seen[1]
        if quiet <= self.limit:
            return None
        replayed = self.replayed.get(peer)
        if replayed is not None:
            return Finding(
                "silent", peer,
                f"rank {peer} sent no new heartbeat for {quiet:.1f}s (liveness timeout {self.limit:g}s), and "
                f"its status record went back from beat {replayed[0]} to {replayed[1]}: someone replays its "
                "old records over it (a process without the token reaches the store), or it is dead",
            )  # fmt: skip
        return Finding(
            "silent", peer,
            f"rank {peer} stopped its heartbeat: last heard {quiet:.1f}s ago (liveness timeout "
            f"{self.limit:g}s; dead, stopped or cut off)",
        )  # fmt: skip

    def gone(self, peer: int) -> Finding | None:
        if peer in self.closed:
            broken = self.closed[peer]
            why = f" after it broke: {broken}" if broken else ""
            return Finding("closed", peer, f"rank {peer} closed the group{why}")
        return None

    def _found(self, finding: Finding) -> None:
        self.finding = finding
        self._wake()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.limit + 5)
