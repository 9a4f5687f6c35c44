"""A source's side of its streams: the one fill of a full stream (:class:`Packed`), the one send loop of every
stream (:func:`post_stream`), the fan-out stream (:func:`send_stream`; pairs: :mod:`._sharded_tx`), and the
one end of every source's sync (:func:`source_sync`: the vote, the acknowledgements, then the delta bases
kept, the policy taught and the stats).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ..control import Deadline
from ..stateless import StatelessGroup
from . import _bytes
from ._copier import Copier
from ._delta_sync import Policy, delta_digest
from ._described import Pairs
from ._session import Session, committed, merged_plan
from ._sharded_delta import Bases
from ._source import Puller, SourceReads
from ._stats import SyncStats, finished
from .plan import Plan
from .transports import Sync, TxTransport

if TYPE_CHECKING:
    from ._delta_tx import DeltaSender

Progress = Callable[[int, int], None]
"""``progress(bytes_sent, total_bytes)``, called after every bucket."""


class Packed:
    """A full stream's fill, a fan-out's or a pair's: each bucket of ``reads.cut`` taken where it lies (the
    source laid out as the cut), else packed on the copy thread into the source's delta ``base`` (one copy,
    not two) or the transport's buffer; then digested (for receiver ``to``). With ``sample``, one bucket of
    at least half the policy's sample is brought up to date in the base by ``sample(view, k)``, which times
    a diff on the way. ``in_place`` counts the buckets sent from the source's own storage."""

    def __init__(
        self, reads: SourceReads, copier: Copier, digests: _bytes.Digests, *,
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


Fill = Callable[[int, Callable[[], torch.Tensor]], torch.Tensor]


def post_stream(
    tx: TxTransport, plan: Plan, device: torch.device, sync: Sync[Any], fill: Fill,
    posted: Callable[[int], None] | None = None, *, finish: bool = True, progress: Progress | None = None,
) -> None:  # fmt: skip
    """The one send loop of every stream (a fan-out, each group of a fan-out delta, a source's pairs): open
    the transport on ``plan``, then per bucket ``fill(k, buffer)`` (packing into ``buffer()``, the
    transport's, or returning bytes that lie elsewhere), post it, call ``progress`` and ``posted(k)``.
    ``finish=False`` leaves the last bytes on the wire (a delta's next group is diffed meanwhile)."""
    tx.open(plan, device, sync)
    for k in range(len(plan.bounds)):
        start, end = plan.bucket_range(k)
        tx.post(k, fill(k, partial(tx.buffer, k, end - start, device)))
        if progress is not None:
            progress(end, plan.total_bytes)
        if posted is not None:
            posted(k)
    if finish:
        tx.finish()


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
) -> SyncStats:  # fmt: skip
    """The one end of every source's sync, one stream or many: ``streams()`` sends this source's streams
    (every byte posted), then the vote (with the digests of the replicated cells it holds, ``replicas()``)
    and every receiver's acknowledgement. Only then do the delta bases it began hold the version and the
    policy learn from what the sync cost; a failure leaves them holding none (the next sync is whole) and
    runs ``cleanup``. Returns the sync's stats."""
    version = session.header.version
    t0 = time.perf_counter()
    try:
        sent = streams()
        receivers = committed(group, session, deadline, replicas() if replicas is not None else None)
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
    return finished(
        group, version, sent.total, seconds,
        buckets=sent.buckets, in_place_buckets=sent.in_place, transport=transport, receivers=len(receivers),
        wire_bytes=sent.wire_bytes, changed_fraction=sent.changed, delta=sent.delta,
        base_bytes=bases.nbytes if bases is not None else 0,
        by_receiver=dict.fromkeys(receivers, sent.total) if sent.by_receiver is None else sent.by_receiver,
    )  # fmt: skip


def send_stream(
    group: StatelessGroup, session: Session, plan: Plan, items: Pairs, device: torch.device, tx: TxTransport,
    sync: Sync[Any], copier: Copier, progress: Progress | None, delta: DeltaSender | None,
) -> Sent:  # fmt: skip
    """A source's fan-out stream of the agreed one-source session: every bucket filled (:class:`Packed`) and
    posted, or a delta against ``delta``'s base (see :func:`source_sync` for what follows)."""
    header, manifest, me = session.header, session.manifest, group.rank
    if session.merged:
        plan = merged_plan(manifest)
    puller = Puller(manifest, iter(items))
    base, sample = delta.prepare(session, plan, device) if delta is not None else (None, False)
    digests = _bytes.Digests("" if session.delta else header.verify, group)
    if session.delta:
        assert delta is not None and base is not None
        sent = delta.send(tx, plan, sync, base, puller, delta_digest(header), progress)
    else:
        reads = puller.reads(plan)
        sampler = partial(delta.sample, puller, plan) if delta is not None and sample else None
        fill = Packed(reads, copier, digests, base=base, sample=sampler)
        post_stream(tx, plan, device, sync, fill, reads.release, progress=progress)
        sent = Sent(plan.total_bytes, len(plan.buckets), plan.total_bytes, fill.in_place)
    puller.pull_through(len(puller.entries) - 1)  # trailing aliases and empty tensors
    digests.send((r, None) for r in range(group.world_size) if r != me)
    return sent
