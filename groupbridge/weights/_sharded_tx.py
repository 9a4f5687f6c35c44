"""A source's part of a many-source sync (see :mod:`._sharded`): its pieces, the vote, the acks."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from ..control import Deadline
from ..errors import SyncRefusedError
from ..stateless import StatelessGroup, Work
from . import _bytes, _delta, _sharded
from ._copier import Copier
from ._delta_sync import Description, delta_digest
from ._session import collect_acks
from ._shard_plan import Bucket, ShardPlan
from ._sharded import ShardedSession, Slot, piece_view, start_of, vote
from ._sharded_delta import bucket_word
from ._stats import SyncStats
from .shard import Box

if TYPE_CHECKING:
    from .sender import Boxes, WeightSender

__all__ = ["send_sharded", "send_shards"]


def send_shards(x: _sharded.Exchange, fault: Callable[[int, torch.Tensor], None] | None = None) -> Sent:
    """This source's part of step 3: every receiver's buckets, all pairs at once (a delta pair: its
    description, then its changed buckets' encodings). ``fault`` (a test hook) sees every bucket before it
    is sent."""
    group, session = x.group, x.session
    plan, verify = session.plan, session.header.verify
    queues: dict[int, deque[Callable[[], torch.Tensor]]] = {}
    digests: dict[int, list[int | bytes]] = {}
    sent = Sent()
    for dst, buckets, base, delta in x.pairs(sending=True):
        if delta:
            assert base is not None
            queues[dst] = _describe_delta(
                group, session, dst, buckets, x.slots, base, x.copier, x.buffers, sent
            )
            continue
        digests[dst] = []
        queues[dst] = deque(
            partial(
                _full_bucket,
                k,
                b,
                dst,
                x.slots,
                plan,
                x.copier,
                x.buffers,
                base,
                verify,
                digests[dst],
                group,
                fault,
            )
            for k, b in enumerate(buckets)
        )
    pending: dict[int, deque[Work]] = {dst: deque() for dst in queues}
    while any(queues.values()):
        for dst, queue in queues.items():
            if not queue:
                continue
            make = queue.popleft()
            if len(pending[dst]) >= _sharded.IN_FLIGHT:
                pending[dst].popleft().wait(x.deadline)
            buf = make()
            work = group.send(buf, dst, async_op=True)
            assert work is not None
            pending[dst].append(work)
            sent.wire_bytes += buf.numel()
    for works in pending.values():
        while works:
            works.popleft().wait(x.deadline)
    if verify:
        for dst, ds in digests.items():
            group.send_obj(ds, dst, tag=_sharded.DIGEST_TAG)
    return sent


@dataclass
class Sent:
    wire_bytes: int = 0
    changed_words: int = 0
    compared_words: int = 0


def _full_bucket(
    k: int, bucket: Bucket, dst: int, slots: Mapping[str, Slot], plan: ShardPlan, copier: Copier,
    buffers: _bytes.BufferCache, base: torch.Tensor | None, verify: str, digests: list[int | bytes],
    group: StatelessGroup, fault: Callable[[int, torch.Tensor], None] | None,
) -> torch.Tensor:  # fmt: skip
    """Pack bucket k of a whole pair (into its base too, when kept); the tensor to send."""
    buf = buffers.get(f"send{dst}-{k % _sharded.IN_FLIGHT}", bucket.nbytes, torch.device("cpu"))
    copier.run(partial(_pack, bucket, buf, slots, plan))
    if base is not None:
        start = start_of(plan.buckets(group.rank, dst), k)
        copier.copy(base[start : start + bucket.nbytes], buf)
    if verify:
        digests.append(_bytes.digest(buf, verify, group))
    if fault is not None:
        fault(k, buf)
    return buf


def _describe_delta(
    group: StatelessGroup, session: ShardedSession, dst: int, buckets: tuple[Bucket, ...],
    slots: Mapping[str, Slot], base: torch.Tensor, copier: Copier, buffers: _bytes.BufferCache, sent: Sent,
) -> deque[Callable[[], torch.Tensor]]:  # fmt: skip
    """A delta pair: diff every bucket against the base (bringing it up to the new version), send the
    pair's description; the sends of the changed buckets' encodings, in order."""
    plan, kind = session.plan, delta_digest(session.header)
    encs, digests, wire, pos = [], [], [], 0
    biggest = max((b.nbytes for b in buckets), default=1)
    mask = buffers.get("delta-mask", biggest, torch.device("cpu")).view(torch.bool)
    for b in buckets:
        w = bucket_word(b, plan.dtypes)
        new = buffers.get("delta-new", b.nbytes, torch.device("cpu"))
        copier.run(partial(_pack, b, new, slots, plan))
        old = base[pos : pos + b.nbytes]
        enc = copier.run(partial(_delta.encode, new, old, w, mask))
        payload = enc.payload if enc.payload is not None else (old if enc.code is _delta.Code.DENSE else None)
        encs.append((enc, payload))
        digests.append(_bytes.digest(old, kind, group))
        if payload is not None:
            wire.append(_bytes.digest(payload, kind, group))
        sent.changed_words += enc.count
        sent.compared_words += enc.words
        pos += b.nbytes
    desc = Description(
        tuple(e.code for e, _ in encs), tuple(e.count for e, _ in encs), tuple(digests), tuple(wire)
    )
    group.send_obj(desc.to_wire(), dst, tag=_sharded.DELTA_TAG)
    return deque(partial(_same, p) for _, p in encs if p is not None)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _pack(bucket: Bucket, buf: torch.Tensor, slots: Mapping[str, Slot], plan: ShardPlan) -> None:
    """Copy the bucket's pieces in; the alignment gaps between them are zeroed (a bucket's bytes, and so
    its digest and its delta, depend on the tensors alone)."""
    with torch.no_grad():
        end = 0
        for p in bucket.pieces:
            if p.offset > end:
                buf[end : p.offset].zero_()
            tensor, box = slots[p.name]
            piece_view(buf, p.offset, p.nbytes, plan.dtypes[p.name], p.box.shape).copy_(
                tensor[p.box.slices(box.offset)]
            )
            end = p.offset + p.nbytes


def send_sharded(
    snd: WeightSender,
    session: ShardedSession,
    items: list[tuple[str, torch.Tensor]],
    shards: Boxes,
    deadline: Deadline,
) -> SyncStats:
    """This member's part of a many-source sync: its pieces to every receiver, the vote, the acks."""
    t0 = time.perf_counter()
    slots = {
        name: (t, Box(shards[name][1] if name in shards else (0,) * t.dim(), tuple(t.shape)))
        for name, t in items
    }
    bases = snd._pair_bases
    try:
        exchange = _sharded.Exchange(snd.group, session, slots, snd._copier, snd._scratch, deadline, bases)
        sent = send_shards(exchange, snd._fault)
        version = session.header.version
        vote(snd.group, version, None, deadline)
        receivers = [r for r in range(snd.group.world_size) if r not in session.sources]
        failures = collect_acks(snd.group, receivers, deadline)
        if failures:
            raise SyncRefusedError(f"version {version} was not applied everywhere:\n" + "\n".join(failures))
    except BaseException:
        if bases is not None:
            bases.abandon()
        raise
    if bases is not None:
        bases.commit(version)
    seconds = time.perf_counter() - t0
    mine = {pair: b for pair, b in session.plan.pairs.items() if pair[0] == snd.src}
    total = sum(b.nbytes for buckets in mine.values() for b in buckets)
    snd.group.log.info(
        "sent my shards of version %d: %.1f MB (%.1f MB on the wire%s) in %.3fs", version, total / 1e6,
        sent.wire_bytes / 1e6, ", deltas" if session.deltas else "", seconds,
    )  # fmt: skip
    return SyncStats(
        version=version,
        bytes=total,
        seconds=seconds,
        gb_per_s=total / seconds / 1e9 if seconds > 0 else float("inf"),
        buckets=sum(len(b) for b in mine.values()),
        in_place_buckets=0,
        transport="p2p",
        receivers=len(receivers),
        wire_bytes=sent.wire_bytes,
        changed_fraction=sent.changed_words / sent.compared_words if sent.compared_words else 1.0,
        delta=any(pair[0] == snd.src for pair in session.deltas),
        base_bytes=bases.nbytes if bases is not None else 0,
    )
