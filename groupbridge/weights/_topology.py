"""A sync's topology, the same on every member once the handshake is over: one source's whole tensors fanned
out to every receiver over one stream (:class:`Fanout`), or one stream per (source, receiver) pair, cut by
the many-source plan (:class:`Pairs`). The session holds one (``Session.topology``); what differs between
the two cases is here, one implementation each: whose streams feed a receiver, what transport carries
them, a member's streams, the order a receiver takes their buckets in, and what it forwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _delta
from ._shard_plan import ShardPlan
from ._sharded_delta import Bases, bucket_word
from ._streams import Stream, parts_of
from .manifest import Manifest
from .plan import Plan
from .transports import pair_transport

__all__ = ["Fanout", "Pairs", "Topology"]

Pair = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Fanout:
    """One source's whole tensors to every receiver, over one stream cut by ``cut`` (the merged plan where
    every member agreed to it, see ``plan.MERGED_BYTES``)."""

    source: int
    cut: Plan[Any]

    def feeding(self, me: int) -> list[int]:
        """The members whose streams reach receiver ``me``: the source."""
        return [self.source]

    def carrier(self, transport: str) -> str:
        """The transport that carries this sync's streams, given the one the source chose: that one."""
        return transport

    def fan(self, me: int) -> int:
        """The receivers source ``me`` posts to itself, pair by pair: none (it posts its stream once)."""
        return 0

    def streams(
        self,
        me: int,
        sending: bool,
        bases: Bases | None,
        device: torch.device,
        manifest: Manifest,
        deltas: frozenset[Pair],
        base: torch.Tensor | None = None,
    ) -> list[Stream]:
        """The one stream, alike on the source and each receiver: its words where it travels as a delta,
        ``base`` the source's (see ``DeltaSender.prepare``; a receiver keeps its own in its applier)."""
        delta = bool(deltas)
        words = tuple(_delta.word_size(self.cut, manifest, k) for k in range(len(self.cut.bounds)) if delta)
        parts = parts_of(self.cut, delta)
        return [Stream(self.source, None, self.source, self.cut, words, base, delta, manifest.digest, parts)]

    def walk(self, me: int, lengths: Mapping[int, int]) -> list[tuple[int, int]]:
        """The (source, bucket) receiver ``me`` takes, in order: the stream's buckets as they come."""
        return [(s, k) for s, n in lengths.items() for k in range(n)]

    def forwards(self, me: int) -> dict[int, int]:
        """What receiver ``me`` passes on, source to next receiver: nothing."""
        return {}


@dataclass(frozen=True, slots=True)
class Pairs:
    """One stream per (source, receiver) pair, each cut by ``plan`` (see :mod:`._shard_plan`); ``keys``: the
    key of each of this member's pairs' cuts (how its base is kept); ``fans``: each source's number of
    receivers it posts to itself (from its verdict: how a receiver lands a source's shared buckets, see
    ``_intake.Intake``)."""

    plan: ShardPlan
    keys: Mapping[Pair, str] = field(default_factory=dict)
    fans: Mapping[int, int] = field(default_factory=dict)

    def feeding(self, me: int) -> list[int]:
        """The members whose streams reach receiver ``me``: sources, and receivers that forward to it."""
        return sorted({self.plan.feeder(s, d) for s, d in self.plan.pairs if d == me})

    def carrier(self, transport: str) -> str:
        """Pairs travel over the transport that carries pairs (``shm`` on one host, ``p2p`` across hosts)."""
        return pair_transport(transport)

    def fan(self, me: int) -> int:
        """The receivers source ``me`` posts to itself (a chain's later receivers take from a forwarder)."""
        return len({d for (s, d) in self.plan.pairs if s == me and self.plan.feeder(s, d) == me})

    def streams(
        self,
        me: int,
        sending: bool,
        bases: Bases | None,
        device: torch.device,
        manifest: Manifest,
        deltas: frozenset[Pair],
        base: torch.Tensor | None = None,
    ) -> list[Stream]:
        """This member's pair streams, as their source (``sending``) or receiver, their bases begun for it on
        ``device`` where bases are kept (``base`` is a fan-out's alone)."""
        plan, out = self.plan, []
        forwarding = {(s, u) for (s, _), u in plan.upstream.items()}  # pairs whose receiver passes them on
        for (src, dst), cut in plan.pairs.items():
            if (src if sending else dst) != me:
                continue
            peer, key = (dst if sending else src), self.keys[(src, dst)]
            begun = bases.begin(peer, key, cut.total_bytes, device)[0] if bases is not None else None
            delta = (src, dst) in deltas
            words = tuple(bucket_word(pieces, plan.dtypes) for pieces in cut.buckets if delta)
            chained = (src, dst) in plan.upstream or (src, dst) in forwarding
            out.append(
                Stream(
                    src,
                    dst,
                    plan.feeder(src, dst),
                    cut,
                    words,
                    begun,
                    delta,
                    key,
                    parts_of(cut, False),
                    chained,
                )
            )
        return out

    def walk(self, me: int, lengths: Mapping[int, int]) -> list[tuple[int, int]]:
        """The (source, bucket) receiver ``me`` takes, in the one order every member walks a sync's pairs:
        by step (the bucket's round plus its hop: a forwarded pair's bucket k is taken a step after its
        forwarder took it, a wavefront down every chain at once, where walking rounds in lockstep would make
        each round wait for its longest chain), then hop, the turn of the cut's first receiver (see
        ``ShardPlan.turn``) and source. Along a chain every receiver walks the cut alike, so what a forwarder
        passes on arrives in the order the next receiver takes it (``p2p`` matches a pair's sends and
        receives in order)."""
        plan = self.plan
        hops = {s: plan.hop(s, me) for s in lengths}
        key = {s: (hops[s], plan.turn(s, plan.head(s, me)), s) for s in lengths}
        events = ((s, k) for s, n in lengths.items() for k in range(n))
        return sorted(events, key=lambda e: (e[1] + hops[e[0]], key[e[0]]))

    def forwards(self, me: int) -> dict[int, int]:
        """What receiver ``me`` passes on along a chain (see ``ShardPlan.upstream``): source to next
        receiver."""
        return {s: d for (s, d), u in self.plan.upstream.items() if u == me}


Topology = Fanout | Pairs
"""How a sync's bytes travel: one fan-out stream or pair streams."""
