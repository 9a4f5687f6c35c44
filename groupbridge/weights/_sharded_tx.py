"""A source's part of a many-source sync (see :mod:`._sharded`): its pieces, the vote, the acks."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..control import Deadline
from ..errors import SyncRefusedError
from ._session import collect_acks
from ._sharded import ShardedSession, send_shards, vote
from ._stats import SyncStats
from .shard import Box

if TYPE_CHECKING:
    from .sender import Boxes, WeightSender

__all__ = ["send_sharded"]


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
    sent = send_shards(snd.group, session, slots, snd._copier, snd._scratch, deadline, snd._fault)
    version = session.header.version
    vote(snd.group, version, None, deadline)
    receivers = [r for r in range(snd.group.world_size) if r not in session.sources]
    failures = collect_acks(snd.group, receivers, deadline)
    if failures:
        raise SyncRefusedError(f"version {version} was not applied everywhere:\n" + "\n".join(failures))
    seconds = time.perf_counter() - t0
    buckets = sum(len(b) for (s, _), b in session.plan.pairs.items() if s == snd.src)
    snd.group.log.info("sent my shards of version %d: %.1f MB in %.3fs", version, sent / 1e6, seconds)
    return SyncStats(
        version=version,
        bytes=sent,
        seconds=seconds,
        gb_per_s=sent / seconds / 1e9 if seconds > 0 else float("inf"),
        buckets=buckets,
        in_place_buckets=0,
        transport="p2p",
        receivers=len(receivers),
        wire_bytes=sent,
    )
