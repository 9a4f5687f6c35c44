"""A source's side of a full stream: pull, pack and post every bucket of the plan, pipelined.

For each bucket: the source's tensors it needs are pulled (a lazy source yields them one at a time), the
bucket is taken straight from their storage when they lie in the plan's layout, else packed (on the copy
thread) into the transport's buffer, or into the kept base when the source keeps one for deltas; then
posted. The transport's ``buffer()`` blocks while the buffer is still in flight: that is the pipeline's
back-pressure. Tensors are released as soon as their last bucket is posted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ..stateless import StatelessGroup
from . import _bytes
from ._copier import Copier
from ._delta_sync import Policy, delta_digest
from ._described import Pairs
from ._session import Session, Stream, committed, merged_plan
from ._source import Puller
from ._stats import SyncStats, finished
from .plan import Plan
from .transports import Sync, TxTransport

if TYPE_CHECKING:
    from ._delta_tx import DeltaSender

__all__ = ["Progress", "post_stream", "send_full", "send_stream"]

Progress = Callable[[int, int], None]
"""``progress(bytes_sent, total_bytes)``, called after every bucket."""


def send_full(
    tx: TxTransport,
    stream: Stream,
    puller: Puller,
    copier: Copier,
    digests: _bytes.Digests,
    *,
    base: torch.Tensor | None = None,
    sample: Callable[[torch.Tensor, int], None] | None = None,
    progress: Progress | None = None,
) -> int:
    """Send every bucket of ``stream.plan``, digested into ``digests``; returns how many were posted straight
    from the tensors' own storage. With ``base`` (the source keeps one for deltas) each bucket is
    also written there, packed there rather than into the transport's buffer (one copy, not two); with
    ``sample``, one bucket of at least half the sample size is brought up to date by ``sample(view, k)``
    instead (which times a diff on the way)."""
    plan = stream.plan
    live = puller.live
    in_place = 0

    def fill(k: int, buffer: Callable[[], torch.Tensor]) -> torch.Tensor:
        nonlocal in_place, sample
        segs = plan.buckets[k]
        puller.pull_through(max(seg.index for seg in segs))
        start, end = plan.bucket_range(k)
        view = _bytes.in_place_bucket(plan, k, puller.direct, receiving=False)
        if view is not None:
            in_place += 1
            if base is not None:
                copier.copy(base[start:end], view)
        elif base is not None and sample is not None and end - start >= Policy.SAMPLE_BYTES // 2:
            view = base[start:end]
            copier.run(partial(sample, view, k))
            sample = None  # one bucket per full sync
        else:
            # a kept base is where the bucket is packed (one copy, not two); else the transport's buffer
            view = base[start:end] if base is not None else buffer()
            copier.run(partial(_bytes.pack, view, segs, live, puller.wire))
        digests.take(view)
        return view

    def posted(k: int) -> None:
        if progress is not None:
            progress(plan.bucket_range(k)[1], plan.total_bytes)
        puller.release(plan, k)

    post_stream(tx, plan, stream.device, stream.sync, fill, posted)
    puller.pull_through(len(puller.entries) - 1)  # trailing aliases and empty tensors
    return in_place


Fill = Callable[[int, Callable[[], torch.Tensor]], torch.Tensor]
"""``fill(k, buffer)``: bucket k's bytes, packed into ``buffer()`` (the transport's) or lying elsewhere."""


def post_stream(
    tx: TxTransport, plan: Plan, device: torch.device, sync: Sync[Any], fill: Fill,
    posted: Callable[[int], None] | None = None,
) -> None:  # fmt: skip
    """The one send loop of every stream, a fan-out or a source's pairs: open the transport on ``plan``
    (its buckets' sizes), then for each bucket ``fill(k, buffer)`` (which packs it into ``buffer()``, the
    transport's, or returns bytes that lie elsewhere) and post it; ``posted(k)`` after each. The
    transport's ``buffer()`` blocks while that buffer is still in flight: the pipeline's back-pressure."""
    tx.open(plan, device, sync)
    for k in range(len(plan.bounds)):
        start, end = plan.bucket_range(k)
        tx.post(k, fill(k, partial(tx.buffer, k, end - start, device)))
        if posted is not None:
            posted(k)
    tx.finish()


def send_stream(
    group: StatelessGroup, session: Session, plan: Plan, items: Pairs, device: torch.device, tx: TxTransport,
    sync: Sync[Any], copier: Copier, progress: Progress | None, delta: DeltaSender | None,
) -> SyncStats:  # fmt: skip
    """A source's stream of the agreed one-source session (full, or a delta with ``delta``'s base), then the
    commit: the vote, every receiver's acknowledgement. Returns the sync's stats (and ``delta``'s policy
    learns from them)."""
    header, manifest, me = session.header, session.manifest, group.rank
    if session.merged:
        plan = merged_plan(manifest)
    t0 = time.perf_counter()
    stream = Stream(me, plan, sync, device)
    puller = Puller(manifest, iter(items))
    base, sampler = None, None
    if delta is not None:
        base, sample = delta.prepare(session, plan, device)
        sampler = partial(delta.sample, puller, plan) if sample else None
    try:
        if session.delta:
            assert delta is not None
            sent = delta.send(tx, stream, puller, delta_digest(header), progress)
            in_place, wire_bytes, changed = sent.in_place, sent.wire_bytes, sent.changed
        else:
            digests = _bytes.Digests(header.verify, group)
            in_place = send_full(
                tx, stream, puller, copier, digests, base=base, sample=sampler, progress=progress
            )
            digests.send((r, None) for r in range(group.world_size) if r != me)
            wire_bytes, changed = plan.total_bytes, 1.0
        receivers = committed(group, session, sync.deadline)
    except BaseException:
        if delta is not None:  # the base it began holds no version any receiver acknowledged
            delta.abandon()
        raise
    seconds = time.perf_counter() - t0
    if delta is not None:
        delta.record(session, seconds, plan.total_bytes, wire_bytes, changed)
    return finished(
        group, header.version, plan.total_bytes, seconds,
        buckets=len(plan.buckets), in_place_buckets=in_place, transport=header.transport,
        receivers=len(receivers), wire_bytes=wire_bytes, changed_fraction=changed, delta=session.delta,
        base_bytes=delta.nbytes if delta is not None else 0,
        by_receiver=dict.fromkeys(receivers, plan.total_bytes),
    )  # fmt: skip
