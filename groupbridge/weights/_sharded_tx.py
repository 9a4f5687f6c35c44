"""A source's streams of a sync of pairs (see :mod:`._sharded`): its pieces to each receiver, a lazy source
pulled as they are packed; the vote and the acknowledgements follow in :func:`._tx_stream.source_sync`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

import torch
import xxhash

from ..control import Deadline
from ..errors import CopyTimeoutError
from ..stateless import StatelessGroup
from . import _bytes, _delta_sync
from ._copier import Copier
from ._delta_sync import delta_digest
from ._delta_tx import Diffs
from ._described import Boxes, Pairs
from ._session import Session
from ._shard_plan import Piece, ShardPlan
from ._sharded import Slot, pairs_of, piece_parts
from ._sharded_delta import Bases, bucket_word
from ._source import Puller, SourceReads
from ._tx_stream import Packed, Progress, Sent, as_is, post_stream
from .manifest import Manifest
from .plan import Plan
from .shard import Box
from .transports import Sync, TxTransport


class _Post(NamedTuple):
    """One bucket of a source's stream: its round, its receiver, its size on the wire, ``fill(buffer)``,
    which packs it (into ``buffer()``, the transport's) and returns the bytes to post, and ``posted()``."""

    round: int
    receiver: int
    nbytes: int
    fill: Callable[[Callable[[], torch.Tensor]], torch.Tensor]
    posted: Callable[[], None] | None = None


def _describe_delta(
    group: StatelessGroup, session: Session, cut: Plan[Piece], slots: SourceSlots, base: torch.Tensor,
    workers: list[Copier], buffers: _bytes.BufferCache, sent: Sent,
) -> tuple[_delta_sync.Description, list[torch.Tensor]]:  # fmt: skip
    """A delta pair: diff every bucket against the base (bringing it up to the new version, see
    :class:`._delta_tx.Diffs`); the pair's description and the changed buckets' encodings, in order."""
    plan = session.pairs
    words = [bucket_word(pieces, plan.dtypes) for pieces in cut.buckets]
    diffs = Diffs(slots.reads(cut), base, words, workers, buffers, delta_digest(session.header), group)
    desc, payloads, done = diffs.described(0, len(cut.bounds))
    sent.changed_words += sum(d.enc.count for d, _ in done)
    sent.compared_words += sum(d.enc.words for d, _ in done)
    return desc, payloads


class SourceSlots:
    """Where this source's boxes live, by wire name. A list of pairs is read at once; a lazy source is
    pulled (on the caller's thread) as the buckets that read its tensors are packed, each tensor checked
    against the manifest and let go once the last of those buckets is packed."""

    def __init__(self, manifest: Manifest, items: Pairs, shards: Boxes, plan: ShardPlan, me: int) -> None:
        self._shards, self._dtypes = shards, plan.dtypes
        self._puller = Puller(manifest, iter(items))
        self._lazy = not isinstance(items, list)
        self._slots: dict[str, Slot] = {}
        self._replicated: dict[str, list[Box]] = {}
        for name, cell, holders in plan.replicated:
            if me in holders:
                self._replicated.setdefault(name, []).append(cell)
        self._replicas: dict[str, Future[str]] = {}
        self._hasher: ThreadPoolExecutor | None = None
        self._left: Counter[str] = Counter(
            p.name for (src, _), cut in plan.pairs.items() if src == me for b in cut.buckets for p in b
        )
        if not self._lazy:
            self.finish()

    def reads(self, cut: Plan[Piece]) -> SourceReads:
        """How a pair's stream cut by ``cut`` reads this source."""
        return SourceReads(
            cut,
            pack=lambda k, into: self.pack(cut.buckets[k], into),
            pull=lambda k: self.need(cut.buckets[k]),
            release=lambda k: self.packed(cut.buckets[k]),
        )

    def pack(self, pieces: tuple[Piece, ...], into: torch.Tensor) -> None:
        _bytes.pack_parts(into, piece_parts(pieces, self._slots, self._dtypes))

    def need(self, pieces: tuple[Piece, ...]) -> None:
        """Pull every tensor these pieces (a bucket's) read."""
        for p in pieces:
            while p.name not in self._slots:
                if not self._pull():  # pulled every entry: the plan names one the manifest does not
                    raise ValueError(f"the plan reads {p.name!r}, which this source's manifest does not list")

    def packed(self, pieces: tuple[Piece, ...]) -> None:
        """A bucket of these pieces is packed: a lazy source's tensors no later bucket reads are let go."""
        if not self._lazy:
            return
        for p in pieces:
            self._left[p.name] -= 1
            if self._left[p.name] <= 0:
                self._slots.pop(p.name, None)

    def replicas(self, deadline: Deadline) -> dict[str, str]:
        """The digest of every replicated cell this source holds (see ``ShardPlan.replicated``), for the
        vote to compare across each cell's holders. Taken on a thread of their own as tensors are pulled
        (hashing releases the GIL), so they overlap the stream instead of adding to it."""
        try:
            return {where: f.result(timeout=max(deadline.left(), 0.0)) for where, f in self._replicas.items()}
        except FutureTimeout:
            raise CopyTimeoutError(f"digesting this source's replicated cells ran past {deadline}") from None
        finally:
            self.close()

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=False, cancel_futures=True)
            self._hasher = None

    def finish(self) -> None:
        """Pull the rest (a generator that gathers runs to its end on every source alike)."""
        while self._pull():
            pass

    def _pull(self) -> bool:
        if self._puller.done:
            return False
        _, e, t = self._puller.take()
        name = e.name
        offset = self._shards[name][1] if name in self._shards else (0,) * t.dim()
        for cell in self._replicated.get(name, ()):
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="groupbridge-replicas")
            where = f"{name} at {list(cell.offset)} of shape {list(cell.shape)}"
            self._replicas[where] = self._hasher.submit(_cell_digest, t[cell.slices(offset)])
        if self._left[name] > 0 or not self._lazy:
            self._slots[name] = (t, Box(offset, tuple(t.shape)))
        return True


def _cell_digest(cell: torch.Tensor) -> str:
    data = cell.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def pair_streams(
    group: StatelessGroup, session: Session, slots: SourceSlots, workers: list[Copier],
    buffers: _bytes.BufferCache, tx: TxTransport, sync: Sync[Any], bases: Bases | None, device: torch.device,
    progress: Progress | None = None,
) -> Sent:  # fmt: skip
    """This source's streams of a sync of pairs: every receiver's buckets as one stream over ``tx`` (its
    buffers and bases on ``device``), in the order every member walks them (round, then turn: see
    ``Session.turns``). A full pair's buckets are packed as a fan-out's are (:class:`._tx_stream.Packed`, on
    the first of the copy threads ``workers``); a delta pair's description goes first on the control plane
    (its buckets diffed by all ``workers``), then its changed buckets' encodings take its buckets' place.
    ``progress(bytes_posted, total)`` after every bucket; every tensor of a lazy source is pulled."""
    me, plan = group.rank, session.pairs
    stream: list[_Post] = []
    digests = _bytes.Digests(session.header.verify, group)
    sent = Sent(delta=any(pair[0] == me for pair in session.deltas))
    pairs = pairs_of(session, me, True, bases, device)
    # pairs of one cut share a base: a delta brings it up to date once (described before any full pair's
    # bytes are packed, so it diffs the old bytes), and else the first full pair of the cut writes it
    described: dict[str, tuple[_delta_sync.Description, list[torch.Tensor]]] = {}
    written = {p.key for p in pairs if p.delta}
    for pair in pairs:
        dst, cut, base = pair.peer, pair.cut, pair.base
        sent.total += cut.total_bytes
        sent.buckets += len(cut.bounds)
        if pair.delta:
            assert base is not None
            if pair.key not in described:
                described[pair.key] = _describe_delta(
                    group, session, cut, slots, base, workers, buffers, sent
                )
            desc, payloads = described[pair.key]
            _delta_sync.announce(group, desc, dst, sync.deadline)
            if plan.feeder(me, dst) == me:  # else a receiver forwards the payloads to it
                stream += [
                    _Post(j, dst, p.numel(), partial(as_is, payloads, j)) for j, p in enumerate(payloads)
                ]
            continue
        if plan.feeder(me, dst) != me:  # its bytes are forwarded by a receiver
            continue
        keep = base if pair.key not in written else None
        written.add(pair.key)
        reads = slots.reads(cut)
        fill = Packed(reads, workers[0], digests, base=keep, to=dst)
        stream += [
            _Post(k, dst, end - start, partial(fill, k), partial(reads.release, k))
            for k, (start, end) in enumerate(cut.bounds)
        ]
    turns = session.turns()  # a source's pairs are each the first of its cut: walk_of's order, hop 0
    stream.sort(key=lambda e: (e.round, turns[(me, e.receiver)]))
    wire = Plan.of_sizes([e.nbytes for e in stream])

    def posted(k: int) -> None:
        done = stream[k].posted
        if done is not None:
            done()

    to = tuple(e.receiver for e in stream)
    post_stream(tx, wire, device, replace(sync, to=to), lambda k, buf: stream[k].fill(buf), posted,
                progress=progress)  # fmt: skip
    sent.wire_bytes += wire.total_bytes
    digests.send((p.peer, plan.head(me, p.peer)) for p in pairs if not p.delta)
    slots.finish()
    sent.by_receiver = {p.peer: p.cut.total_bytes for p in sorted(pairs, key=lambda p: p.peer)}
    return sent
