"""A group's object operations: point-to-point objects, broadcast, all-gather and barrier over the control
channel, with their sequence numbers, and the collection of finished collectives' keys.

Objects are encoded by :mod:`groupbridge.codec` (pickled only when the group allows it). Point-to-point
objects travel in queues (one per sender, receiver and tag), so nothing of them is left to delete. A
collective writes keys that every rank reads; they are deleted lazily: each rank posts a *watermark* (the
last collective it finished) every ``WATERMARK_EVERY`` collectives and at every barrier, and rank 0's
liveness watcher, at each beat (every ``liveness_timeout / 5``, at least 50 ms), deletes the keys of the
collectives that every rank's watermark has passed. So a collective's keys stay in the store until every
rank has posted a watermark past it and rank 0's watcher has beaten once more; keys of the collectives after
a rank's last watermark stay until its next one (or until the store goes, with rank 0's close).

An all-gather of more than :data:`DIRECT_MAX` members goes through rank 0: each member posts its object,
rank 0 reads them all in one request and posts them once, identical objects once, and each member reads that
one value. The store then serves about 2N requests per gather, not N^2, and a member reads the distinct
objects once (thousands of members posting one layout cost one copy of it). A barrier of more than
:data:`DIRECT_MAX` members goes through rank 0 alike: each member's arrival is read once, by rank 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import msgpack

from .. import codec
from .._seal import Sealer
from ..control import ControlChannel, Deadline, Route
from ..errors import PeerTimeoutError, ProtocolError
from ..store import StoreClient
from .state import GroupState

__all__ = ["DIRECT_MAX", "INLINE_MAX", "MAX_PARTS", "WATERMARK_EVERY", "Objects"]

WATERMARK_EVERY = 16
MAX_PARTS = 64
"""The most fields one member's gathered dict may have (``all_gather_obj(by_field=True)``)."""
DIRECT_MAX = 8
"""Up to this many members, each reads every other's object itself: one round trip, where going through
rank 0 takes two; above it, the N^2 reads of one store cost more (see the module's docstring)."""
INLINE_MAX = 64 << 10
"""A broadcast object larger than this is stored once and read by every receiver, not queued to each."""
_INLINE = b"v"
_AT_KEY = b"k"


class Objects:
    """One member's object operations (see the module docstring); the group's methods of the same names
    delegate here. Each checks that the group is open, then its arguments, before anything moves."""

    def __init__(
        self, state: GroupState, control: ControlChannel, sealer: Sealer, allow_pickle: bool
    ) -> None:
        self._state = state
        self._control = control
        self._sealer = sealer
        self._allow_pickle = allow_pickle
        self._coll_seq = 0
        self._send_seq: dict[tuple[int, str], int] = {}
        self._recv_seq: dict[tuple[int, str], int] = {}
        self._broadcast_routes: dict[int, Route] = {}
        self.garbage: deque[tuple[int, list[str]]] = deque()
        """Rank 0: (collective number, its keys) of finished collectives, oldest first, until deleted."""

    def start(self) -> None:
        """Post this member's first watermark (no collective passed), so that rank 0 can read every rank's."""
        self._control.put(f"wm/{self._state.rank}", b"0", "joining")

    def _encode(self, obj: Any) -> bytes:
        return codec.encode(obj, allow_pickle=self._allow_pickle)

    def _decode(self, data: bytes, src: int) -> Any:
        try:
            return codec.decode(data, allow_pickle=self._allow_pickle)
        except ProtocolError as e:
            raise self._malformed(e, src) from e

    def _malformed(self, e: ProtocolError, src: int) -> ProtocolError:
        s = self._state
        return ProtocolError(f"rank {s.rank} of {s.where()}: object from rank {src}: {e}")

    @staticmethod
    def _check_tag(tag: str) -> None:
        if not isinstance(tag, str) or "/" in tag:
            raise ValueError(f"tag={tag!r} must be a str without '/'")

    def send_obj(self, obj: Any, dst: int | Sequence[int], tag: str) -> None:
        rank = self._state.rank
        self._state.check_open()
        dsts = (dst,) if isinstance(dst, int) else tuple(dst)
        for d in dsts:
            self._state.check_peer(d, "dst")
        if len(set(dsts)) != len(dsts):
            raise ValueError(f"dst={list(dsts)} names a rank twice")
        self._check_tag(tag)
        data = self._encode(obj)
        if len(dsts) == 1:  # the common case, as cheap as it was
            (d,) = dsts
            channel = f"p2p/{tag}/{rank}/{d}"
            seq = self._send_seq.get((d, tag), 0)
            self._control.push(self._control.route(channel, [channel]), seq, data, "send_obj")
            self._send_seq[(d, tag)] = seq + 1
            return
        messages = []
        for d in dsts:
            channel = f"p2p/{tag}/{rank}/{d}"
            messages.append((self._control.route(channel, [channel]), self._send_seq.get((d, tag), 0), data))
        self._control.push_each(messages, "send_obj")
        for d, (_, seq, _) in zip(dsts, messages, strict=True):
            self._send_seq[(d, tag)] = seq + 1

    def recv_obj(self, src: int, timeout: timedelta | Deadline | None, tag: str) -> Any:
        s = self._state
        s.check_open()
        s.check_peer(src, "src")
        self._check_tag(tag)
        seq = self._recv_seq.get((src, tag), 0)
        channel = f"p2p/{tag}/{src}/{s.rank}"
        route = self._control.route(channel, [channel])
        data = self._control.pop(route, seq, src, s.deadline(timeout), f"object #{seq} (tag {tag!r})")
        self._recv_seq[(src, tag)] = seq + 1
        return self._decode(data, src)

    def _broadcast_route(self, src: int) -> Route:
        """Make and keep the queues of broadcasts from ``src``: its route to every other rank, or this rank's
        from it. Made once per source (a broadcast's cost is mostly the Python around its two store calls);
        :meth:`broadcast_obj` looks in ``_broadcast_routes`` first."""
        s = self._state
        binding = f"bc/{src}"
        ranks = [r for r in range(s.world_size) if r != src] if s.rank == src else [s.rank]
        route = self._broadcast_routes[src] = self._control.route(binding, [f"{binding}/{r}" for r in ranks])
        return route

    def _next_seq(self) -> int:
        self._coll_seq += 1
        return self._coll_seq

    def _done_collective(self, seq: int, keys: list[str], *, flush: bool = False) -> None:
        """Keys of a finished collective are deleted by rank 0's watcher once every rank has passed it.

        Each rank posts how far it got every ``WATERMARK_EVERY`` collectives (and at every barrier), not
        after each: a store request per operation is a third of a small object's cost.
        """
        rank = self._state.rank
        if rank == 0 and keys:
            self.garbage.append((seq, keys))
        if flush or seq % WATERMARK_EVERY == 0:
            self._control.post(f"wm/{rank}", str(seq).encode(), "a collective")

    def collect(self, client: StoreClient) -> None:
        """On rank 0's watcher thread, at each beat: delete the keys of the collectives every rank has
        finished."""
        if not self.garbage:
            return
        ns, store = self._state.namespace, client.get()
        raws = store.multi_get([f"{ns}/wm/{r}" for r in range(self._state.world_size)])
        try:
            passed = min(int(bytes(self._sealer.open(f"{ns}/wm/{r}", bytes(v)))) for r, v in enumerate(raws))
        except (ValueError, ProtocolError):  # a forged or torn watermark: collect later
            return
        while self.garbage and self.garbage[0][0] <= passed:
            for key in self.garbage[0][1]:
                store.delete_key(f"{ns}/{key}")
            self.garbage.popleft()  # only once deleted: an empty deque means the keys are gone

    def broadcast_obj(self, obj: Any, src: int, timeout: timedelta | Deadline | None) -> Any:
        # Written for a small object, the common case: its cost is mostly the Python it runs, with caches
        # cold (the caller has just woken), so the checks that pass are inline and the codec is called as is.
        s, control = self._state, self._control
        if s.closed or s.broken is not None:
            s.check_open()
        if type(src) is not int or not 0 <= src < s.world_size:
            s.check_rank(src, "src")
        if s.world_size == 1:
            codec.encode(obj, allow_pickle=self._allow_pickle)
            return obj
        # a refused object or timeout consumes no sequence, on any rank (the source checks a timeout given)
        data = codec.encode(obj, allow_pickle=self._allow_pickle) if s.rank == src else b""
        deadline = s.deadline(timeout) if s.rank != src or timeout is not None else None
        self._coll_seq = seq = self._coll_seq + 1
        route = self._broadcast_routes.get(src)
        if route is None:
            route = self._broadcast_route(src)
        keys = []
        if s.rank == src:
            if len(data) > INLINE_MAX and len(route.queues) > 1:  # one copy in the store, read by everyone
                keys = [f"bc/{seq}"]
                control.put(keys[0], data, "broadcast_obj")
                control.push(route, seq, _AT_KEY, "broadcast_obj")
            else:
                control.push(route, seq, _INLINE + data, "broadcast_obj")
            if keys or seq % WATERMARK_EVERY == 0:  # else _done_collective has nothing to do
                self._done_collective(seq, keys)
            return obj
        what = "a broadcast object"
        assert deadline is not None
        msg = control.pop(route, seq, src, deadline, what)
        if msg == _AT_KEY:
            keys = [f"bc/{seq}"]
            msg = _INLINE + control.get_one(keys[0], src, deadline, what)
        elif not msg.startswith(_INLINE):
            raise ProtocolError(f"rank {s.rank} of {s.where()}: malformed broadcast from rank {src}")
        if keys or seq % WATERMARK_EVERY == 0:  # else _done_collective has nothing to do
            self._done_collective(seq, keys)
        try:
            return codec.decode(msg[1:], allow_pickle=self._allow_pickle)
        except ProtocolError as e:
            raise self._malformed(e, src) from e

    def all_gather_obj(
        self, obj: Any, timeout: timedelta | Deadline | None, by_field: bool = False
    ) -> list[Any]:
        """Every rank's ``obj``. ``by_field``: ``obj`` is a dict whose values travel (and are read) each on
        its own, so a value many members post alike is sent once and decoded once, whatever their other
        values (see the module's docstring)."""
        s = self._state
        s.check_open()
        parts = self._parts(obj, by_field)
        if s.world_size == 1:
            return [obj]
        deadline = s.deadline(timeout)  # a refused timeout consumes no sequence
        seq = self._next_seq()
        keys = [f"ag/{seq}/{r}" for r in range(s.world_size)]
        plain = not by_field and s.world_size <= DIRECT_MAX  # one object, read by each member itself
        self._control.post(keys[s.rank], parts[0] if plain else msgpack.packb(parts), "all_gather_obj")
        others = s.others()
        if s.world_size > DIRECT_MAX:
            posted = self._gathered(parts, seq, keys, deadline)
            self._done_collective(seq, [*keys, f"ag/{seq}/all"])
        else:
            got = self._control.get([keys[r] for r in others], others, deadline, "all_gather_obj")
            self._done_collective(seq, keys)
            if plain:
                out = [obj] * s.world_size
                for r, value in zip(others, got, strict=True):
                    out[r] = self._decode(value, r)
                return out
            posted = [parts] * s.world_size
            for r, value in zip(others, got, strict=True):
                posted[r] = self._unpacked(value, r)
        decoded: dict[bytes, Any] = {}
        return [
            obj if r == s.rank else self._assembled(p, r, by_field, decoded) for r, p in enumerate(posted)
        ]

    def gather_obj(
        self, obj: Any, srcs: Sequence[int], dsts: Sequence[int], timeout: timedelta | Deadline | None
    ) -> dict[int, Any] | None:
        """Every rank calls it: each of ``srcs`` posts ``obj`` and returns once the store holds it; each of
        ``dsts`` returns every source's object by rank (its own included); the others return None at once.
        The store serves one request per source and one per reader, where point-to-point messages from
        each source to each reader cost S x R (a sync's acknowledgements from hundreds of receivers)."""
        s = self._state
        s.check_open()
        senders, readers = sorted(set(srcs)), set(dsts)
        for r in senders:
            s.check_rank(r, "srcs")
        for r in readers:
            s.check_rank(r, "dsts")
        deadline = s.deadline(timeout) if s.rank in readers else None
        data = self._encode(obj) if s.rank in senders else b""  # a refused object consumes no number
        seq = self._next_seq()
        keys = {r: f"ga/{seq}/{r}" for r in senders}
        if data:
            self._control.put(keys[s.rank], data, "gather_obj")
        out: dict[int, Any] | None = None
        if deadline is not None:
            others = [r for r in senders if r != s.rank]
            got = self._control.get([keys[r] for r in others], others, deadline, "gather_obj")
            out = {r: self._decode(bytes(v), r) for r, v in zip(others, got, strict=True)}
            if data:
                out[s.rank] = obj
            out = dict(sorted(out.items()))
        self._done_collective(seq, list(keys.values()))  # deleted once every rank (every reader) passed it
        return out

    def _parts(self, obj: Any, by_field: bool) -> list[bytes]:
        """What a member posts: its object's encoding, or (``by_field``) its keys' and then each value's."""
        if not by_field:
            return [self._encode(obj)]
        if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
            raise TypeError(f"by_field=True gathers a dict with str keys, got {type(obj).__name__}")
        return [self._encode(list(obj)), *(self._encode(v) for v in obj.values())]

    def _unpacked(self, raw: bytes, src: int) -> list[bytes]:
        try:
            parts = msgpack.unpackb(raw, max_bin_len=len(raw), max_array_len=MAX_PARTS)
        except (ValueError, msgpack.UnpackException, TypeError) as e:
            raise self._malformed(ProtocolError(f"a malformed gathered object ({e})"), src) from e
        if not (isinstance(parts, list) and parts and all(isinstance(p, bytes) for p in parts)):
            raise self._malformed(ProtocolError("a malformed gathered object"), src)
        return parts

    def _assembled(self, parts: list[bytes], src: int, by_field: bool, decoded: dict[bytes, Any]) -> Any:
        """A rank's object from its parts; a part already decoded (posted alike by another rank) is reused."""
        values = []
        for part in parts:
            if part not in decoded:
                decoded[part] = self._decode(part, src)
            values.append(decoded[part])
        if not by_field:
            return values[0]
        names = values[0]
        if not (
            isinstance(names, list)
            and len(names) == len(values) - 1
            and all(isinstance(n, str) for n in names)
        ):
            raise self._malformed(ProtocolError("a malformed gathered dict"), src)
        return dict(zip(names, values[1:], strict=True))

    def _gathered(
        self, parts: list[bytes], seq: int, keys: list[str], deadline: Deadline
    ) -> list[list[bytes]]:
        """An all-gather through rank 0 (see the module's docstring): rank 0 posts the distinct parts and
        which ones each rank posted; every rank's parts, in rank order."""
        posted: list[list[bytes]] = []

        def combine(got: list[bytes]) -> bytes:
            others = self._state.others()
            posted.extend([parts, *(self._unpacked(bytes(v), r) for r, v in zip(others, got, strict=True))])
            distinct: dict[bytes, int] = {}
            index = [[distinct.setdefault(p, len(distinct)) for p in rank_parts] for rank_parts in posted]
            return msgpack.packb([list(distinct), index])  # type: ignore[no-any-return]

        raw = self._through_root(keys, f"ag/{seq}/all", combine, deadline, "all_gather_obj")
        if self._state.rank == 0:
            return posted
        values, index = self._combined(raw, self._state.world_size)
        return [[values[i] for i in rank_index] for rank_index in index]

    def _through_root(
        self,
        keys: list[str],
        out: str,
        combine: Callable[[list[bytes]], bytes] | bytes,
        deadline: Deadline,
        what: str,
    ) -> bytes:
        """A collective through rank 0 (every rank posted ``keys[rank]``): rank 0 reads the others' keys in
        one request and posts ``out`` (``combine`` of what it read, or a constant); every other rank reads
        ``out``, and a timeout names the ranks rank 0 still waits for. Returns ``out``'s value."""
        s, control = self._state, self._control
        others = s.others()
        if s.rank == 0:
            got = control.get([keys[r] for r in others], others, deadline, what)
            value = combine(got) if callable(combine) else combine
            control.put(out, value, what)
            return value
        try:
            return control.get_one(out, 0, deadline, what)
        except PeerTimeoutError as e:  # name the members rank 0 still waits for
            late = control.missing([keys[r] for r in others], others)
            raise control.late(what, late or [0], deadline) from e

    def _combined(self, raw: bytes, world_size: int) -> tuple[list[bytes], list[list[int]]]:
        """Rank 0's gathered value, checked before use: (distinct parts, each rank's parts' indices)."""
        try:
            values, index = msgpack.unpackb(
                raw, max_bin_len=len(raw), max_array_len=max(world_size * MAX_PARTS, MAX_PARTS)
            )
        except (ValueError, msgpack.UnpackException, TypeError) as e:
            raise self._malformed(ProtocolError(f"a malformed all-gather ({e})"), 0) from e
        if not (
            isinstance(values, list)
            and isinstance(index, list)
            and len(index) == world_size
            and all(isinstance(v, bytes) for v in values)
            and all(
                isinstance(ix, list)
                and 0 < len(ix) <= MAX_PARTS
                and all(type(i) is int and 0 <= i < len(values) for i in ix)
                for ix in index
            )
        ):
            raise self._malformed(ProtocolError("a malformed all-gather"), 0)
        return values, index

    def barrier(self, timeout: timedelta | Deadline | None) -> None:
        s = self._state
        s.check_open()
        if s.world_size == 1:
            return
        deadline = s.deadline(timeout)  # a refused timeout consumes no sequence
        seq = self._next_seq()
        keys = [f"bar/{seq}/{r}" for r in range(s.world_size)]
        self._control.post(keys[s.rank], b"1", "barrier")
        others = s.others()
        if s.world_size <= DIRECT_MAX:
            self._control.get([keys[r] for r in others], others, deadline, "the barrier")
        else:  # through rank 0, as an all-gather: every rank reading every other's key would be N^2 reads
            self._through_root(keys, f"bar/{seq}/all", b"1", deadline, "the barrier")
            keys.append(f"bar/{seq}/all")
        self._done_collective(seq, keys, flush=True)
