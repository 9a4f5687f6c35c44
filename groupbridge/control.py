"""The group's control channel: group-scoped keys in the store, sealed, acknowledged and bounded.

Every control message of a group (objects, weight-sync headers, bucket signals, acknowledgements) goes
through one :class:`ControlChannel`, so the rules hold in one place:

- writes the caller relies on are acknowledged (TCPStore's ``set`` is not: a write into a dead store would
  otherwise "succeed");
- values are sealed with the group's token when it has one (see :mod:`groupbridge._seal`), and a value that
  fails the check is never returned: the reader waits for the real one until its deadline;
- every wait is one server-side wait bounded by the caller's deadline, woken early when the liveness
  watcher sees a peer fail (it shuts the connection down), and a timeout names the ranks not heard from.

Two shapes of message: *keys* (``put``/``get``: read by several ranks, deleted by someone once all have
read them) and *queues* (``push``/``pop``: one reader per queue; popping consumes the message, so nothing
is left to delete and the reader usually needs one round trip, not two). Objects between members travel
in queues; weight-sync signals, barriers and gathers use keys.

A reader with nothing to pop waits in torch's blocking pop: one call that waits on the queue and pops as
soon as it is woken, so the message follows the wake without a trip back through Python (the same cost
as a ``get`` of a key). torch's server leaves a client registered on a queue it once waited on (a push
wakes the waiter but does not forget it), with two effects this channel lives with:

- a later push to that queue ends whatever that client waits for next (a *stray wake*: routine for a
  member that reads from several channels). So no value written through the channel is empty, an empty
  read means "not there yet" and the wait goes on, whatever woke it; a pop that a stray wake ends finds
  the queue empty and waits again. Process groups, whose own waits do not know this, get a connection of
  their own (:attr:`GroupState.pg_client <groupbridge._group.state.GroupState.pg_client>`);
- each push walks every registration left, and a queue waited on once (a tag used once) would keep one on
  the server for good, so the queues a reader waited on are cleared at the liveness watcher's next beat,
  on its own connection, off the caller's path (:meth:`ControlChannel.sweep`: a ``compare_set`` of the
  queue's name, which wakes and forgets its waiters without creating the key; a reader waiting on it
  then takes that as a stray wake).

A push wakes one waiter, the first registered: a process that reaches the port can take a reader's wake by
waiting on its queue, as it can take the message by popping it (denial of service, see docs/security.md).
"""

from __future__ import annotations

import collections
import logging
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import NamedTuple, NoReturn, TypeVar

from ._fmt import ranks, seconds
from ._seal import ForgedMessageError, Sealer
from ._torch_private import QueueEmptyError, TCPStore
from .errors import GroupBridgeError, PeerTimeoutError, ProtocolError, StoreUnreachableError
from .store import StoreClient

logger = logging.getLogger(__name__)

__all__ = ["ControlChannel", "Deadline", "Route"]

T = TypeVar("T")

_FORGED_RETRY_S = 0.005
_SEQ = struct.Struct("<Q")
MAX_EARLY = 1024
_ABSENT = "groupbridge: no such key"


class Deadline:
    """One deadline for a whole operation (a sync, a join): every wait inside takes what is left."""

    __slots__ = ("at", "total")

    def __init__(self, total: timedelta) -> None:
        self.total = total
        self.at = time.monotonic() + total.total_seconds()

    def left(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def poll(self, ready: Callable[[], T | None], interval: float) -> T | None:
        """Call ``ready`` until it returns something other than None, or this deadline passes (then None;
        ``ready`` runs once more at the deadline). For the few checks that have no server-side wait."""
        while True:
            out = ready()
            if out is not None:
                return out
            left = self.left()
            if left <= 0:
                return None
            time.sleep(min(interval, left))

    def __str__(self) -> str:
        return seconds(self.total)


class Route(NamedTuple):
    """A queue channel's names in the store (made by :meth:`ControlChannel.route`): the binding its seals
    cover, and the queues it writes (a sender's route) or the one it reads (a receiver's). Kept by callers
    that use a channel often, so that a message costs no formatting of names."""

    binding: str
    queues: tuple[str, ...]


class ControlChannel:
    """Group-scoped keys for one member (see the module docstring); made by :class:`StatelessGroup`.

    Args:
        client: this member's store connection.
        prefix: the group's namespace; every key is relative to it.
        sealer: seals and opens values (a no-op without a token).
        rank: this member's rank, for messages.
        where: describes the group for messages.
        failure: the group's failure, if the liveness watcher saw one (raised instead of a store error).
        awaiting: called with the ranks a wait depends on, so the watcher wakes it if one of them fails.
    """

    def __init__(
        self,
        client: StoreClient,
        prefix: str,
        sealer: Sealer,
        rank: int,
        where: Callable[[], str],
        failure: Callable[[], GroupBridgeError | None],
        awaiting: Callable[[Sequence[int]], None],
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.sealer = sealer
        self.rank = rank
        self._where = where
        self._failure = failure
        self._awaiting = awaiting
        self._warned_forgery = False
        self._discarded: collections.deque[str] = collections.deque()
        """Keys every reader is done with, deleted by :meth:`sweep` on the liveness watcher's connection."""
        self._early: dict[tuple[str, int], bytes] = {}
        """Messages popped ahead of their turn (a peer without the token may reorder a queue by popping and
        pushing back), kept until their number comes up."""
        self._waited: set[str] = set()
        """Queues this reader waited on since the watcher last cleared their registrations (:meth:`sweep`)."""
        self.waits = 0
        """Blocking pops made, stray wakes included."""

    def key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    # ------------------------------------------------------------------ plumbing

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run one store call, turning torch's errors into the group's (the watcher's finding first)."""
        self._check_failure()
        try:
            return fn()
        except GroupBridgeError:
            raise
        except (RuntimeError, OSError) as e:
            self._store_failed(e, what)

    def _check_failure(self) -> None:
        """Raise the group's failure (the liveness watcher's finding), if it has one."""
        failed = self._failure()
        if failed is not None:
            try:
                raise failed
            finally:  # no cycle through this frame (it would keep a failed sync's buffers until collected)
                del failed

    def _store_failed(self, e: BaseException, what: str) -> NoReturn:
        """Raise for a store call that failed with ``e``: the watcher's finding if it has one (a peer died,
        the store went), else :class:`StoreUnreachableError`."""
        failed = self._failure()
        if failed is not None:
            try:
                raise failed from e
            finally:
                del failed
        raise StoreUnreachableError(
            f"rank {self.rank}: the store of {self._where()} (hosted by rank 0) did not answer during "
            f"{what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e

    def _forged(self, key: str) -> None:
        if not self._warned_forgery:
            self._warned_forgery = True
            logger.warning(
                "rank %d of %s: the store holds a value for %r that is not sealed with the group's token "
                "(someone without the token wrote it); ignoring it and waiting for the real one",
                self.rank, self._where(), key,
            )  # fmt: skip

    # ------------------------------------------------------------------ writes

    def _sealed(self, full: str, payload: bytes) -> bytes:
        if not payload:
            raise ValueError(f"an empty value for {full!r}: the store reads a missing key as empty")
        return self.sealer.seal(full, payload)

    def put(self, key: str, payload: bytes, what: str) -> None:
        """Write ``key`` (a non-empty ``payload``) and return once the store has it (one round trip)."""
        full = self.key(key)
        data = self._sealed(full, payload)
        store = self.client.get()

        def write() -> None:
            store.set(full, data)  # type: ignore[arg-type]
            store.check([full])  # answered after the set was applied: the acknowledgement

        self.call(write, what)

    def post(self, key: str, payload: bytes, what: str) -> None:
        """Write ``key`` (a non-empty ``payload``) without waiting for the store (the next acknowledged call
        on this connection is answered after it)."""
        full = self.key(key)
        data = self._sealed(full, payload)
        store = self.client.get()
        self.call(lambda: store.set(full, data), what)  # type: ignore[arg-type]

    def route(self, binding: str, queues: Sequence[str]) -> Route:
        """The full names of a queue channel: ``binding`` (e.g. ``bc/<src>``) and its ``queues``. The binding
        its seals cover is not a key's name, so a queued message copied into a key fails the check."""
        return Route(self.key(binding) + "#queue", tuple(self.key(q) for q in queues))

    def push(self, route: Route, seq: int, payload: bytes, what: str) -> None:
        """Append message number ``seq`` to each of ``route``'s queues and return once the store has them
        (one round trip, whatever the number of queues).

        The seal covers the route's binding and ``seq``, so a message moved to another channel fails the
        check and a stale or replayed one is recognised by its number.
        """
        # Written out (no closures, no call()): this is the path of every small control message, whose cost
        # is mostly the Python it runs, with caches cold (the caller has just woken).
        item = _SEQ.pack(seq) + payload
        if self.sealer.enabled:
            item = self.sealer.seal(route.binding, item)
        store = self.client.get()
        queues = route.queues
        self._check_failure()
        try:  # torch's calls only: a GroupBridgeError (an OSError too) must not reach the handler
            for q in queues:
                store.queue_push(q, item)
            store.check([queues[-1]])  # answered after the pushes were applied: the acknowledgement
        except (RuntimeError, OSError) as e:
            self._store_failed(e, what)

    def push_each(self, messages: Sequence[tuple[Route, int, bytes]], what: str) -> None:
        """:meth:`push` of each (route, seq, payload), in one round trip (``send_obj`` to several ranks)."""
        sealer = self.sealer
        store = self.client.get()
        self._check_failure()
        last = None
        try:  # torch's calls only: a GroupBridgeError (an OSError too) must not reach the handler
            for route, seq, payload in messages:
                item = _SEQ.pack(seq) + payload
                if sealer.enabled:
                    item = sealer.seal(route.binding, item)
                for q in route.queues:
                    store.queue_push(q, item)
                    last = q
            if last is not None:
                store.check([last])  # answered after the pushes were applied: the acknowledgement
        except (RuntimeError, OSError) as e:
            self._store_failed(e, what)

    def pop(self, route: Route, seq: int, owner: int, deadline: Deadline, what: str) -> bytes:
        """Message number ``seq`` of ``route``'s queue (pushed by ``owner``), consumed.

        One round trip when the message is already there, else one more call: torch's blocking pop, bounded
        by the deadline (see the module docstring). Forged messages and stale ones (numbered below ``seq``:
        left by a wait that gave up) are dropped.

        Raises:
            PeerTimeoutError: the deadline passed (names ``owner``).
            ProtocolError: more than ``MAX_EARLY`` messages came ahead of their turn.
            PeerDiedError, StoreUnreachableError: a peer or the store failed meanwhile.
        """
        (full,) = route.queues
        early = self._early.pop((full, seq), None)
        if early is not None:
            return early
        store = self.client.get()
        sealer = self.sealer

        # The store call is written out (no closures, no call()): after a wake, this is the path of every
        # small control message, whose cost is mostly the Python it runs, with caches cold.
        awaiting = False  # told to the watcher only before a wait: a message already there takes one trip
        try:
            wait = False
            while True:
                if wait:
                    if not awaiting:
                        self._awaiting((owner,))
                        awaiting = True
                    self._waited.add(full)
                    self.waits += 1
                left = deadline.left()
                if left <= 0:
                    raise self._late(what, [owner], deadline)
                if wait:
                    store.set_timeout(timedelta(seconds=left))
                self._check_failure()
                try:  # torch's call only: a GroupBridgeError (an OSError too) must not reach the handlers
                    raw: bytes | None = store.queue_pop(full, block=wait)
                except QueueEmptyError:
                    raw = None  # nothing there yet, or a stray wake ended the wait (module docstring)
                except (RuntimeError, OSError) as e:
                    if deadline.left() < 0.01 and not self.client.interrupted and self._failure() is None:
                        raise self._late(what, [owner], deadline) from e  # the wait ran out of time
                    self._store_failed(e, what)
                if raw is None:
                    if wait and self.call(lambda: self._squatted(store, full), what):  # do not spin
                        time.sleep(_FORGED_RETRY_S)
                    wait = True
                    continue
                wait = False  # whatever this one was, the next may be there already
                body = raw
                if sealer.enabled:
                    try:
                        body = sealer.open(route.binding, raw)
                    except ForgedMessageError:
                        self._forged(full)
                        continue
                if len(body) < _SEQ.size:
                    raise ProtocolError(f"rank {self.rank}: a message in {full!r} has no sequence number")
                (got,) = _SEQ.unpack_from(body)
                if got == seq:
                    return body[_SEQ.size :]
                if got > seq:
                    if len(self._early) >= MAX_EARLY:
                        raise ProtocolError(
                            f"rank {self.rank} of {self._where()}: waiting for message #{seq} of {what} from "
                            f"rank {owner}, {len(self._early)} later ones arrived first"
                        )
                    self._early[(full, got)] = body[_SEQ.size :]
        finally:
            if awaiting:
                self._awaiting(())

    @staticmethod
    def _squatted(store: TCPStore, queue: str) -> bool:
        """A key of ``queue``'s name (not ours) is there: every wait on the queue would end at once."""
        return bool(store.check([queue])) and store.queue_len(queue) == 0

    def add(self, key: str, amount: int, what: str) -> int:
        store = self.client.get()
        return int(self.call(lambda: store.add(self.key(key), amount), what))

    def check(self, keys: Sequence[str], what: str) -> bool:
        store = self.client.get()
        full = [self.key(k) for k in keys]
        return bool(self.call(lambda: store.check(full), what))

    def discard(self, keys: Sequence[str]) -> None:
        """Mark ``keys`` (never written again: their names are unique) as read by everyone; the liveness
        watcher deletes them on its own connection, off the data path, where each delete costs a round
        trip (three per shm bucket with two receivers)."""
        self._discarded.extend(self.key(k) for k in keys)

    def sweep(self, client: StoreClient, budget: float = 0.05) -> None:
        """Delete discarded keys, then clear the registrations torch's server kept on the queues waited on
        (see the module docstring), for at most ``budget`` seconds (the watcher's beat must not wait on a
        long backlog: the rest goes at the next beat); called on the liveness watcher's thread, and at
        close."""
        store = client.get()
        until = time.monotonic() + budget
        while self._discarded and time.monotonic() < until:
            store.delete_key(self._discarded.popleft())
        while self._waited and time.monotonic() < until:
            try:
                queue = self._waited.pop()
            except KeyError:  # taken by the other sweep (close sweeps while the watcher may still beat)
                break
            store.compare_set(queue, _ABSENT, "x")

    def delete(self, keys: Sequence[str], what: str) -> None:
        store = self.client.get()
        for k in keys:
            full = self.key(k)
            self.call(lambda full=full: store.delete_key(full), what)  # type: ignore[misc]

    # ------------------------------------------------------------------ reads

    def get(self, keys: Sequence[str], owners: Sequence[int], deadline: Deadline, what: str) -> list[bytes]:
        """The values of ``keys`` (written by ``owners``), waiting until all exist and are sealed right.

        One server-side wait plus one read when nothing is forged. Bounded by ``deadline`` and woken early
        when one of ``owners`` fails.

        Raises:
            PeerTimeoutError: the deadline passed; names the owners whose keys are missing.
            PeerDiedError, StoreUnreachableError: a peer or the store failed meanwhile.
        """
        store = self.client.get()
        full = [self.key(k) for k in keys]
        out: list[bytes | None] = [None] * len(keys)
        self._awaiting(owners)
        try:
            while True:
                left = deadline.left()
                if left <= 0:
                    raise self._timeout(keys, owners, what, deadline)
                wanted = [full[i] for i, v in enumerate(out) if v is None]
                pending = [i for i, v in enumerate(out) if v is None]
                try:
                    store.set_timeout(timedelta(seconds=left))
                    raw = self.call(lambda wanted=wanted: store.multi_get(wanted), what)  # type: ignore[misc]
                except StoreUnreachableError as e:
                    if deadline.left() < 0.01 and not self.client.interrupted:
                        raise self._timeout(keys, owners, what, deadline) from e
                    raise
                forged = False
                for i, value in zip(pending, raw, strict=True):
                    if not value:  # not written yet: the store's wait ended early (see the module docstring)
                        continue
                    try:
                        out[i] = self.sealer.open(full[i], bytes(value))
                    except ForgedMessageError:
                        forged = True
                        self._forged(keys[i])
                if all(v is not None for v in out):
                    return [v for v in out if v is not None]
                if forged:
                    time.sleep(_FORGED_RETRY_S)
        finally:
            self._awaiting(())

    def get_one(self, key: str, owner: int, deadline: Deadline, what: str) -> bytes:
        return self.get([key], [owner], deadline, what)[0]

    def _timeout(
        self, keys: Sequence[str], owners: Sequence[int], what: str, deadline: Deadline
    ) -> PeerTimeoutError:
        return self._late(what, set(self.missing(keys, owners)) or set(owners), deadline)

    def missing(self, keys: Sequence[str], owners: Sequence[int]) -> list[int]:
        """The owners whose keys are not in the store (a timeout's slow path: one check per key)."""
        store = self.client.get()
        try:
            store.set_timeout(timedelta(seconds=5))
            return [r for k, r in zip(keys, owners, strict=True) if not store.check([self.key(k)])]
        except RuntimeError:  # the store is gone too: name everyone
            return list(owners)

    def late(self, what: str, owners: Iterable[int], deadline: Deadline) -> PeerTimeoutError:
        """The error of a wait for ``what`` from ``owners`` that ran past ``deadline``."""
        return self._late(what, owners, deadline)

    def _late(self, what: str, owners: Iterable[int], deadline: Deadline) -> PeerTimeoutError:
        return PeerTimeoutError(
            f"rank {self.rank} of {self._where()} waited {deadline} for {what} from rank(s) {ranks(owners)}"
        )
