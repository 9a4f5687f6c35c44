"""How a receiver takes its streams: the one receive loop of every stream (:func:`take`, in the order its
topology walks them: ``Topology.walk``), and what a receiver passes on to the next along a chain as it takes
it (:class:`Onward`, see ``ShardPlan.upstream``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from ..control import Deadline
from ..errors import ProtocolError
from ..stateless import StatelessGroup
from .plan import Plan
from .transports import Sync, TxTransport, spec

Feed = tuple[int, Callable[[torch.Tensor, bool], None]]
"""A stream's bucket as its receiver takes it: (bytes, what lands it, given the view and whether it landed in
place)."""


Opened = Iterator[tuple[int, torch.Tensor, bool]]
"""A stream as its transport delivers it (``RxTransport.buckets``): (bucket, view, in place) as each lands."""


def take(streams: Mapping[int, Opened], order: Iterable[int]) -> Opened:
    """The one receive loop of every stream, a fan-out's or pairs': ``order`` names, for each bucket this
    receiver takes, the feeder whose stream brings it (every member walks a sync's buckets in one order, so
    no stream waits on another in a cycle); yields each bucket's (index in its stream, view, in place) as it
    lands. A stream is drained after its last bucket (its transport frees what it holds then): one that ends
    early or brings more than its plan raises."""
    order = list(order)
    left = Counter(order)
    for feeder in order:
        landed = next(streams[feeder], None)
        if landed is None:
            raise ProtocolError(f"rank {feeder}'s stream ended before its plan did")
        yield landed
        left[feeder] -= 1
        if not left[feeder]:
            for _ in streams[feeder]:
                raise ProtocolError(f"rank {feeder}'s stream has more buckets than its plan")


class Onward:
    """What this receiver forwards (``to``: source to next receiver, see ``Topology.forwards``): each bucket
    of a pair it takes whose cut another receiver takes from it, passed on as it lands (copied out first: the
    landing buffer is reused while the send may still be on the wire), in the order this receiver takes
    them, over ``p2p``."""

    def __init__(
        self, group: StatelessGroup, to: Mapping[int, int], walk: list[tuple[int, int]],
        feeds: Mapping[int, list[Feed]], deadline: Deadline, device: torch.device,
    ) -> None:  # fmt: skip
        self.to = dict(to)
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
        """Every bucket passed on is off the wire; then :meth:`close`."""
        if self.tx is not None:
            self.tx.finish()
        self.close()

    def close(self) -> None:
        """Let go of the transport (its buffers, the sends still on the wire): at the end, or on a failure."""
        if self.tx is not None:
            self.tx.close()
            self.tx = None
