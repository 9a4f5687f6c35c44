"""A member's streams of a sync, one :class:`Stream` each (made by the sync's topology, see
:mod:`._topology`): the one fan-out of a source's whole tensors, or its pair streams, each with the parts it
travels in. Pairs land through the one family of appliers (:mod:`._appliers`), as a fan-out stream's buckets
do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._delta_sync import delta_groups
from .plan import Plan


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
    chained: bool = False
    """Its bytes pass through a receiver that forwards them (a chain of more than one pair): its buckets are
    digested whatever the sender's ``checksum``, since a receiver down the chain trusts a peer's copy."""

    def word_counts(self, a: int, b: int) -> list[int]:
        return [
            (end - start) // w for (start, end), w in zip(self.cut.bounds[a:b], self.words[a:b], strict=True)
        ]
