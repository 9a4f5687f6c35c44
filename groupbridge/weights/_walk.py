"""The walk of a sync's pair streams on a receiver: the one order every member takes its buckets in
(:func:`walk_of`), and what a receiver passes on to the next along a chain as it takes it (:class:`Onward`,
see ``ShardPlan.upstream``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..control import Deadline
from ..stateless import StatelessGroup
from ._session import Session
from ._shard_plan import ShardPlan
from .plan import Plan
from .transports import Sync, TxTransport, spec

__all__ = ["Feed", "Onward", "walk_of"]

Feed = tuple[int, Callable[[torch.Tensor], None]]
"""A pair's bucket as its receiver takes it: (bytes, what lands it)."""


def walk_of(session: Session, me: int, lengths: Mapping[int, int]) -> list[tuple[int, int]]:
    """The (source, bucket) this receiver takes, in the one order every member walks a sync's pairs: by
    step (the bucket's round plus its hop: a forwarded pair's bucket k is taken a step after its forwarder
    took it, a wavefront down every chain at once, where walking rounds in lockstep would make each round
    wait for its longest chain), then hop, the turn of the cut's first receiver (see ``Session.turns``) and
    source. Along a chain every receiver walks the cut alike, so what a forwarder passes on to a receiver
    arrives in the order that receiver takes it (``p2p`` matches a pair's sends and receives in order)."""
    plan, turns = session.pairs, session.turns()
    hops = {s: plan.hop(s, me) for s in lengths}
    key = {s: (hops[s], turns[(s, plan.head(s, me))], s) for s in lengths}
    events = ((s, k) for s, n in lengths.items() for k in range(n))
    return sorted(events, key=lambda e: (e[1] + hops[e[0]], key[e[0]]))


class Onward:
    """What this receiver forwards (see ``ShardPlan.upstream``): each bucket of a pair it takes whose cut
    another receiver takes from it, passed on as it lands (copied out first: the landing buffer is reused
    while the send may still be on the wire), in the order this receiver takes them, over ``p2p``."""

    def __init__(
        self, group: StatelessGroup, plan: ShardPlan, walk: list[tuple[int, int]],
        feeds: Mapping[int, list[Feed]], deadline: Deadline, device: torch.device,
    ) -> None:  # fmt: skip
        me = group.rank
        self.to = {s: d for (s, d), u in plan.upstream.items() if u == me}
        self.tx: TxTransport | None = None
        self.device = device
        self.posted = 0
        if not self.to:
            return
        passed = [(s, k) for s, k in walk if s in self.to]
        self.tx = spec("p2p").make_tx(group, spec("p2p").options())
        sizes = [feeds[s][k][0] for s, k in passed]
        self.tx.open(Plan.of_sizes(sizes), device, Sync("", deadline, spec("p2p").options(),
                                                        to=tuple(self.to[s] for s, _ in passed)))  # fmt: skip

    def post(self, src: int, view: torch.Tensor) -> None:
        if self.tx is None or src not in self.to:
            return
        buf = self.tx.buffer(self.posted, view.numel(), self.device)
        buf.copy_(view)
        self.tx.post(self.posted, buf)
        self.posted += 1

    def finish(self) -> None:
        if self.tx is not None:
            self.tx.finish()
            self.tx.close()
