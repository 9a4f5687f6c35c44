"""A source's side of its streams: the one fill of a full stream (:class:`Packed`), the one send loop of every
stream (:func:`post_stream`), a source's streams of a sync, the fan-out or its pairs (:func:`send_streams`),
and the one end of every source's sync (:func:`source_sync`: the vote, the acknowledgements, then the delta
bases kept, the policy taught and the stats).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple, Protocol

import torch

from ..control import Deadline
from ..stateless import StatelessGroup
from . import _bytes, _delta_sync, _digests
from ._copier import Copier
from ._delta_sync import Policy, delta_digest
from ._delta_tx import Diffs
from ._session import Session, committed
from ._sharded_delta import Bases
from ._source import SourceReads
from ._stats import SyncStats, finished
from ._streams import Stream
from .plan import Plan
from .transports import Sync, TxTransport

Progress = Callable[[int, int], None]
"""``progress(bytes_sent, total_bytes)``, called after every bucket."""


class Packed:
    """A full stream's fill, a fan-out's or a pair's: each bucket of ``reads.cut`` taken where it lies (the
    source laid out as the cut), else packed on the copy thread into the source's delta ``base`` (one copy,
    not two) or the transport's buffer; then digested (for receiver ``to``). With ``sample``, one bucket of
    at least half the policy's sample is brought up to date in the base by ``sample(view, k)``, which times
    a diff on the way. ``in_place`` counts the buckets sent from the source's own storage."""

    def __init__(
        self, reads: SourceReads, copier: Copier, digests: _digests.Digests, *,
        base: torch.Tensor | None = None, sample: Callable[[torch.Tensor, int], None] | None = None,
        to: int | None = None,
    ) -> None:  # fmt: skip
        self.reads, self.copier, self.digests = reads, copier, digests
        self.base, self.sample, self.to = base, sample, to
        self.in_place = 0

    def __call__(self, k: int, buffer: Callable[[], torch.Tensor]) -> torch.Tensor:
        reads, base = self.reads, self.base
        reads.pull(k)
        start, end = reads.cut.bucket_range(k)
        view = reads.direct(k)
        if view is not None:
            self.in_place += 1
            if base is not None:
                self.copier.copy(base[start:end], view)
        elif base is not None and self.sample is not None and end - start >= Policy.SAMPLE_BYTES // 2:
            view = base[start:end]
            self.copier.run(partial(self.sample, view, k))
            self.sample = None  # one bucket per full sync
        else:
            view = base[start:end] if base is not None else buffer()
            self.copier.run(partial(reads.pack, k, view))
        self.digests.take(view, self.to)
        return view


class Post(NamedTuple):
    """One bucket of a source's part: its round, its receiver (None: every one), its size on the wire,
    ``fill(buffer)``, which packs it (into ``buffer()``, the transport's) or returns bytes that lie elsewhere,
    and ``posted()``."""

    round: int
    to: int | None
    nbytes: int
    fill: Callable[[Callable[[], torch.Tensor]], torch.Tensor]
    posted: Callable[[], None] | None = None


def post_stream(tx: TxTransport, posts: list[Post], device: torch.device, sync: Sync[Any]) -> None:
    """The one send loop of every stream's part (see :func:`send_streams`): open the transport on the posts'
    sizes, then per bucket fill it, post it and call its ``posted()``. The last bytes are left on the wire
    (a fan-out delta's next group is diffed meanwhile): the caller finishes."""
    tx.open(Plan.of_sizes([e.nbytes for e in posts]), device, sync)
    for k, e in enumerate(posts):
        tx.post(k, e.fill(partial(tx.buffer, k, e.nbytes, device)))
        if e.posted is not None:
            e.posted()


def as_is(payloads: list[torch.Tensor], k: int, buffer: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A fill (see :func:`post_stream`) of bytes posted from where they lie, a delta's payloads: the
    transport copies them if it must."""
    return payloads[k]


@dataclass
class Sent:
    """What a source's streams moved in one sync, for its stats and its delta policy."""

    total: int = 0
    """The bytes of its buckets (what a full sync moves)."""
    buckets: int = 0
    wire_bytes: int = 0
    in_place: int = 0
    changed_words: int = 0
    compared_words: int = 0
    delta: bool = False
    by_receiver: dict[int, int] | None = None
    """Bytes each receiver took (None: every receiver took them all)."""
    streams: dict[str, tuple[int, int]] = field(default_factory=dict)
    """By the cut of each delta stream: its payloads' bytes and its own (for ``Policy.record_stream``)."""

    @property
    def changed(self) -> float:
        """Of the words compared, the fraction that changed (1.0 for a full sync: nothing was compared)."""
        if not self.compared_words:
            return 0.0 if self.delta else 1.0
        return self.changed_words / self.compared_words


def source_sync(
    group: StatelessGroup, session: Session, deadline: Deadline, streams: Callable[[], Sent], *,
    transport: str, bases: Bases | None, policy: Policy | None,
    replicas: Callable[[], Mapping[str, str]] | None = None, cleanup: Callable[[], None] | None = None,
    voted: Callable[[int], None] | None = None,
) -> SyncStats:  # fmt: skip
    """The one end of every source's sync, one stream or many: ``streams()`` sends this source's streams
    (every byte posted), then the vote (with the digests of the replicated cells it holds, ``replicas()``)
    and every receiver's acknowledgement. Only then do the delta bases it began hold the version and the
    policy learn from what the sync cost; a failure leaves them holding none (the next sync is whole) and
    runs ``cleanup``. ``voted`` is told the version once the vote passed (every receiver holds it from then
    on, acknowledged or not). Returns the sync's stats."""
    version = session.header.version
    t0 = time.perf_counter()
    try:
        sent = streams()
        receivers = committed(group, session, deadline, replicas() if replicas is not None else None, voted)
    except BaseException:
        if cleanup is not None:
            cleanup()
        if bases is not None:  # what it began holds no version any receiver acknowledged
            bases.abandon()
        raise
    seconds = time.perf_counter() - t0
    if bases is not None:
        bases.commit(version)
    if policy is not None:
        if sent.delta:
            policy.record_delta(seconds, sent.total, sent.wire_bytes, sent.changed)
        else:
            policy.record_full(seconds, sent.total)
        for key, (wire, nbytes) in sent.streams.items():
            policy.record_stream(key, wire, nbytes)
    return finished(
        group, version, sent.total, seconds,
        buckets=sent.buckets, in_place_buckets=sent.in_place, transport=transport, receivers=len(receivers),
        wire_bytes=sent.wire_bytes, changed_fraction=sent.changed, delta=sent.delta,
        base_bytes=bases.nbytes if bases is not None else 0,
        by_receiver=dict.fromkeys(receivers, sent.total) if sent.by_receiver is None else sent.by_receiver,
    )  # fmt: skip


class Source(Protocol):
    """What a source's streams read: its tensors in a fan-out's (:class:`._source.Puller`) or a pair's cut
    (``_sharded_tx.SourceSlots``)."""

    def reads(self, cut: Plan[Any]) -> SourceReads: ...

    def finish(self) -> None: ...


def send_streams(
    group: StatelessGroup, session: Session, streams: list[Stream], source: Source, workers: list[Copier],
    buffers: _bytes.BufferCache, tx: TxTransport, sync: Sync[Any], device: torch.device,
    progress: Progress | None = None, sample: Callable[[torch.Tensor, int], None] | None = None,
) -> Sent:  # fmt: skip
    """A source's streams of a sync (the fan-out, or its pairs), over ``tx`` in parts: every stream's part
    ``g`` (see ``Stream.parts``), interleaved as every member walks them (round, then turn: see
    ``ShardPlan.turn``), then the next part. A full stream's buckets are packed as they are posted
    (:class:`Packed`, on the first of the copy threads ``workers``; ``sample`` times a diff on the way, see
    there), all in the first part; a delta stream's group is diffed by all ``workers`` (the streams of one cut
    once) and described to its receivers, then its changed buckets' encodings are posted, while the workers
    diff the next group. ``progress(bytes_done, total)`` after every bucket posted or diffed; every tensor of
    a lazy source is pulled. See :func:`source_sync` for what follows."""
    me, header = group.rank, session.header
    chained = {session.pairs.head(me, s.to) for s in streams if s.chained and s.to is not None}
    digests = _digests.Digests(header.verify, group, chained)
    sent = Sent(delta=any(s.delta for s in streams))
    ends: dict[int, int] = {}  # how far each stream's buckets are posted (a delta's: diffed, once per cut)

    def reads_of(i: int) -> SourceReads:
        reads, cut = source.reads(streams[i].cut), streams[i].cut
        ends[i] = 0

        def released(k: int) -> None:
            if progress is not None:
                ends[i] = cut.bucket_range(k)[1]
                progress(sum(ends.values()), total)
            reads.release(k)

        return replace(reads, release=released)

    diffs: dict[str, Diffs] = {}
    fills: list[Packed] = []
    first: list[Post] = []
    # the streams of one cut share a base: a delta brings it up to date once (as it diffs it), and else the
    # first full stream of the cut writes it
    written = {s.key for s in streams if s.delta}
    for i, s in enumerate(streams):
        sent.total += s.cut.total_bytes
        sent.buckets += len(s.cut.bounds)
        if s.delta:
            if s.key not in diffs:
                assert s.base is not None
                verify = delta_digest(header)
                diffs[s.key] = Diffs(reads_of(i), s.base, list(s.words), workers, buffers, verify, group)
        elif s.feeder == me:
            keep = s.base if s.key not in written else None
            written.add(s.key)
            reads = reads_of(i)
            fills.append(Packed(reads, workers[0], digests, base=keep, sample=sample, to=s.to))
            sent.wire_bytes += s.cut.total_bytes
            first += [Post(k, s.to, end - start, partial(fills[-1], k), partial(reads.release, k))
                      for k, (start, end) in enumerate(s.cut.bounds)]  # fmt: skip
    total = sum(streams[i].cut.total_bytes for i in ends)
    opened = False
    for g in range(max((len(s.parts) for s in streams), default=0)):
        posts, described = first if g == 0 else [], {}
        for s in streams:
            if not s.delta or g >= len(s.parts):
                continue
            if s.key not in described:
                desc, payloads, diffed = diffs[s.key].described(*s.parts[g])
                described[s.key] = desc, payloads
                wire, nbytes = sent.streams.get(s.key, (0, s.cut.total_bytes))
                sent.streams[s.key] = wire + sum(p.numel() for p in payloads), nbytes
                sent.changed_words += sum(d.enc.count for d, _ in diffed)
                sent.compared_words += sum(d.enc.words for d, _ in diffed)
                sent.in_place += sum(flat for _, flat in diffed)
            desc, payloads = described[s.key]
            _delta_sync.announce(group, desc, s.to, sync.deadline)
            if s.feeder == me:
                sent.wire_bytes += sum(p.numel() for p in payloads)
                posts += [
                    Post(j, s.to, p.numel(), partial(as_is, payloads, j)) for j, p in enumerate(payloads)
                ]
        if not posts:
            continue
        posts.sort(key=lambda e: (e.round, 0 if e.to is None else session.pairs.turn(me, e.to)))
        if opened:
            tx.finish()  # the previous part's bytes are out; the diff workers kept going meanwhile
        opened = True
        to = None if posts[0].to is None else tuple(e.to for e in posts if e.to is not None)
        post_stream(tx, posts, device, replace(sync, part=g, to=to))
    if opened:
        tx.finish()
    sent.in_place += sum(f.in_place for f in fills)
    receivers = [r for r in range(group.world_size) if r not in session.sources]
    digests.send(  # each full stream's, by the receiver it was posted to (a forwarded pair's: its head)
        (r, None if s.to is None else session.pairs.head(me, s.to))
        for s in streams if not s.delta for r in ([s.to] if s.to is not None else receivers)
    )  # fmt: skip
    source.finish()
    sent.by_receiver = dict(sorted((s.to, s.cut.total_bytes) for s in streams if s.to is not None)) or None
    return sent
