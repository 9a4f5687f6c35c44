"""A member's streams of a sync (:func:`streams_of`), one :class:`Stream` each: the one fan-out of a source's
whole tensors, or its pair streams (one per (source, receiver), walked by every member in one order, see
:func:`._walk.walk_of`), each with the parts it travels in. Pairs travel over a transport that carries them
(``shm`` on one host, ``p2p`` across hosts) and land through the one family of appliers (:mod:`._appliers`),
as a fan-out stream's buckets do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _delta
from ._delta_sync import delta_groups
from ._session import Session
from ._sharded_delta import Bases, bucket_word
from .plan import Plan


def streams_of(
    session: Session,
    me: int,
    sending: bool,
    bases: Bases | None,
    device: torch.device,
    fanout_base: torch.Tensor | None = None,
) -> list[Stream]:
    """This member's streams of the sync, as their source or receiver: the one fan-out stream (its source's
    base ``fanout_base``, see ``DeltaSender.prepare``; a receiver keeps its own where its applier holds the
    tensors), or its pair streams, their bases begun for it on ``device`` when bases are kept."""
    if session.plan is None:
        whole, delta = session.fanout, session.delta
        words = tuple(_delta.word_size(whole, session.manifest, k) for k in range(len(whole.bounds)) if delta)
        key = session.manifest.digest
        parts = parts_of(whole, delta)
        return [Stream(session.src, None, session.src, whole, words, fanout_base, delta, key, parts)]
    plan, out = session.pairs, []
    for (src, dst), cut in plan.pairs.items():
        if (src if sending else dst) != me:
            continue
        peer, key = (dst if sending else src), session.keys[(src, dst)]
        base = bases.begin(peer, key, cut.total_bytes, device)[0] if bases is not None else None
        delta = (src, dst) in session.deltas
        words = tuple(bucket_word(pieces, plan.dtypes) for pieces in cut.buckets if delta)
        out.append(
            Stream(src, dst, plan.feeder(src, dst), cut, words, base, delta, key, parts_of(cut, False))
        )
    return out


def parts_of(cut: Plan[Any], groups: bool) -> tuple[tuple[int, int], ...]:
    """The parts a stream travels in, buckets [a, b) each: a fan-out delta's groups (``groups``: each
    described, then its changed buckets sent, while the source diffs the next; see
    :func:`._delta_sync.delta_groups`), else one. A pair's delta goes in one part: between parts a source
    waits for its last bytes to land, and across hosts that pause cost more than the overlap won (``p2p`` at
    200 Mbit/s, 2 sources of 32 MiB to 2 receivers: one eighth changed, 0.51 s a sync in one part, 0.56 to
    0.64 s in four; one in 64 changed, 0.12 s against 0.11 s)."""
    return tuple(delta_groups(cut)) if groups else ((0, len(cut.bounds)),)


@dataclass(frozen=True, slots=True)
class Stream:
    """One of this member's streams in a sync: its source's bytes cut by ``cut``, to one receiver (a pair) or
    to every receiver (``to`` None: the fan-out of one source's whole tensors)."""

    source: int
    to: int | None
    feeder: int
    """Who posts its bytes to its receiver: the source, or a receiver that forwards them (a chain)."""
    cut: Plan[Any]
    words: tuple[int, ...]
    """Each bucket's comparison word, where it travels as a delta (see :mod:`._delta`)."""
    base: torch.Tensor | None
    """Its base for this sync, when bases are kept (shared by the pairs of one cut); a fan-out's receiver
    keeps it where its applier holds the tensors."""
    delta: bool
    """It travels as a delta."""
    key: str
    """Its cut (:func:`._sharded_delta.pair_key`), or how a fan-out's base is kept."""
    parts: tuple[tuple[int, int], ...]
    """The parts it travels in, buckets [a, b) each (see :func:`parts_of`)."""

    def word_counts(self, a: int, b: int) -> list[int]:
        return [
            (end - start) // w for (start, end), w in zip(self.cut.bounds[a:b], self.words[a:b], strict=True)
        ]
