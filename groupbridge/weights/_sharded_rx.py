"""The intake of pair streams (a many-source sync, or boxes, see :mod:`._sharded`): what a receiver wants,
the walk of its streams, where the pieces land. It runs through :mod:`._receive` as a fan-out stream's
intake does."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from ..codec import dtype_from_name, dtype_name
from ..control import Deadline
from ..stateless import StatelessGroup
from . import _bytes, _delta_sync
from ._appliers import Applier, Ring, Scratch, Staged, Streaming, counts, hand_on
from ._delta_sync import Applied, delta_digest, wire_plan
from ._receive import Intake
from ._rx_stream import KEPT, Taker, allocated
from ._session import Session
from ._shard_plan import Piece, ShardPlan, element_size
from ._sharded import Pair, Slot, pairs_of
from ._sharded_delta import bucket_word
from ._walk import Feed, Onward, take, walk_of
from .plan import Plan
from .shard import Box, Shard, box_of
from .transports import Landing, stream_device


def receive_shards(
    taker: Taker, session: Session, pairs: list[Pair], applier: Applier, device: torch.device,
    deadline: Deadline, problems: list[str],
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """This receiver's part of step 3: land every source's pieces through ``applier`` (keyed by wire name).
    Each source's buckets come over its pair transport (attached in the handshake), read in the order every
    member walks them: round, turn (see ``Session.turns``), source. Yields what the applier hands on of each
    tensor once it is whole (every piece of it landed, from whichever sources); why the bytes are refused (a
    digest mismatch) goes to ``problems``."""
    group = taker.group
    digests = _bytes.Digests(session.header.verify, group)
    checked: list[int] = []
    plan, me = session.pairs, group.rank
    feeds: dict[int, list[Feed]] = {}
    ready: list[tuple[str, torch.Tensor]] = []
    for pair in pairs:
        src, cut = pair.peer, pair.cut
        lander = _Lander(group, session, src, cut, applier, pair.base, problems, ready, digests)
        if pair.delta:
            feeds[src] = lander.delta(deadline)
            yield from hand_on(ready)  # its unchanged buckets were unpacked from the base
        else:
            feeds[src] = [(end - start, partial(lander.full, k)) for k, (start, end) in enumerate(cut.bounds)]
            checked.append(src)
    walk = walk_of(session, me, {s: len(f) for s, f in feeds.items()})
    walks: dict[int, Iterator[tuple[int, torch.Tensor, bool]]] = {}
    for feeder in sorted({plan.feeder(s, me) for s in feeds}):
        mine = [(s, k) for s, k in walk if plan.feeder(s, me) == feeder]
        kind, rx, sync = taker.streams.stream(feeder, session, deadline)
        at = stream_device(kind, device)
        wire = Plan.of_sizes([feeds[s][k][0] for s, k in mine])
        rx.open(wire, at, replace(sync, to=(me,) * len(mine)))
        # A bucket read where it lies (a shared slot) keeps the slot until this receiver comes back to that
        # source's stream; the source may wait for that only when no other receiver's bucket lies between
        # (it has no more receivers than slots), else it could wait on a later bucket: then copy out first.
        receivers = sum(1 for s, _ in plan.pairs if s == feeder)
        slots = getattr(sync.options, "slots", 0)
        landing = Landing.SCRATCH if receivers <= slots else Landing.STAGING
        ring = Ring(taker.buffers, at, f"recv{feeder}-")
        ring.size = rx.scratch_buffers
        walks[feeder] = rx.buckets(wire, ring.land(wire, landing), deadline)
    onward = Onward(group, plan, walk, feeds, deadline, device)
    for (src, k), (_, view, _) in zip(walk, take(walks, (plan.feeder(s, me) for s, _ in walk)), strict=True):
        onward.post(src, view)
        feeds[src][k][1](view)
        yield from hand_on(ready)
    onward.finish()
    for src in checked:
        problem = digests.check(src, deadline)
        if problem is not None:
            problems.append(problem)


class _Lander:
    """One pair's buckets on its receiver: checked, kept in the base (when kept), landed through the applier
    (what it hands on goes to ``ready``)."""

    def __init__(
        self,
        group: StatelessGroup,
        session: Session,
        src: int,
        cut: Plan[Piece],
        applier: Applier,
        base: torch.Tensor | None,
        problems: list[str],
        ready: list[tuple[str, torch.Tensor]],
        digests: _bytes.Digests,
    ) -> None:
        self.group, self.session, self.src, self.cut = group, session, src, cut
        self.applier, self.copier, self.base = applier, applier.copier, base
        self.problems, self.ready, self.digests = problems, ready, digests

    def _land(self, k: int, view: torch.Tensor, moved: set[str] | None = None) -> None:
        """Bucket k's pieces through the applier; ``moved``: the tensors whose bytes changed (None: all)."""
        self.ready += self.applier.landed(self.cut.buckets[k], view, False, moved)

    def full(self, k: int, buf: torch.Tensor) -> None:
        self.digests.take(buf, self.src)
        if self.base is not None:
            self.copier.copy(self._view(k), buf)
        self._land(k, buf)

    def delta(self, deadline: Deadline) -> list[tuple[int, Callable[[torch.Tensor], None]]]:
        """The pair's changed buckets to receive (as its source announced them), each applied to the base
        then landed from it; the unchanged ones are checked and landed from the base at once (see
        :class:`._delta_sync.Applied`)."""
        cut, dtypes = self.cut, self.session.pairs.dtypes
        sizes = [bucket_word(b, dtypes) for b in cut.buckets]
        words = [(end - start) // w for (start, end), w in zip(cut.bounds, sizes, strict=True)]
        desc = _delta_sync.announced(self.group, self.src, False, words, deadline)
        wplan, changed = wire_plan(desc, sizes, words)
        what = f"from rank {self.src}"
        applied = Applied(desc, cut, sizes, delta_digest(self.session.header), self.group, self.copier.run,
                          lambda k: f"bucket {k} {what}", base=self._view, land=self._land)  # fmt: skip
        for k in range(len(cut.bounds)):
            if k not in changed:
                self._vote(applied.unchanged(k))
        return [
            (end - start, partial(self._changed, applied, k, j))
            for j, (k, (start, end)) in enumerate(zip(changed, wplan.bounds, strict=True))
        ]

    def _changed(self, applied: Applied, k: int, j: int, payload: torch.Tensor) -> None:
        self._vote(applied.changed(k, j, payload))

    def _view(self, k: int) -> torch.Tensor:
        assert self.base is not None
        return self.base[slice(*self.cut.bucket_range(k))]

    def _vote(self, problem: str | None) -> None:
        if problem is not None:
            self.problems.append(problem)


def wants_of(targets: dict[str, Any], renames: bool) -> dict[str, Any] | None:
    """What this receiver posts in the handshake when some target is a box of a global tensor (a
    :class:`~.shard.Shard` or a DTensor): every target's box, by name on the wire; else None (every
    tensor, whole)."""
    shards = {n: box_of(v) for n, v in targets.items()}
    if all(s is None for s in shards.values()):
        return None
    if renames:
        raise ValueError("receiving into Shard targets takes the names on the wire: drop rename=")
    wants = {}
    for name, value in targets.items():
        s = shards[name] or Shard(value, tuple(value.shape), (0,) * value.dim())
        wants[name] = [
            dtype_name(s.tensor.dtype),
            list(s.global_shape),
            list(s.offset),
            list(s.tensor.shape),
        ]
    return wants


def data_ptr(t: Any) -> int:
    return _slot(t)[0].data_ptr()


def _slot(value: Any) -> Slot:
    """Where a target holds its box of the global tensor."""
    shard = box_of(value)
    if shard is not None:
        return shard.tensor, shard.box
    return value, Box((0,) * value.dim(), tuple(value.shape))


def _staging(
    taker: Taker, plan: ShardPlan, boxes: Mapping[str, Box], device: torch.device
) -> dict[str, Slot]:
    """One kept buffer (pre-touched after the first sync) holding every wanted box, one view per tensor."""
    offsets, pos = {}, 0
    for wire in (w for w in plan.order if w in boxes):
        offsets[wire] = pos
        pos += -(-boxes[wire].numel * element_size(plan.dtypes[wire]) // 16) * 16
    buffer = taker.buffers.get(KEPT, pos, device)
    return {
        wire: (_bytes.typed_view(buffer, offsets[wire], dtype_from_name(plan.dtypes[wire]), box.shape), box)
        for wire, box in boxes.items()
    }


class Boxes(Intake):
    """Pair streams' pieces landed through ``applier`` (by wire name): a kept staging buffer, the target's own
    boxes, or tensors made as their first piece lands. What it hands on (``receive()``: each tensor once
    every piece of it landed, from whichever sources hold it) is yielded renamed; ``empty``: the wanted
    tensors without a byte, handed on last."""

    def __init__(
        self, taker: Taker, session: Session, applier: Applier, device: torch.device, deadline: Deadline,
        empty: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        super().__init__(applier)
        self.taker, self.session, self.device = taker, session, device
        self.deadline, self.empty = deadline, empty

    def tensors(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        taker, session = self.taker, self.session
        # bases when any source keeps them (each source's header says whether its pairs may be deltas)
        bases = taker.memory.bases if any(h.keeps_base for h in session.headers.values()) else None
        if bases is None:
            taker.memory.bases.clear()  # the senders keep none: nothing to apply a delta to, memory back
        pairs = pairs_of(session, taker.group.rank, False, bases, self.device)
        problems: list[str] = []
        for wire, tensor in receive_shards(taker, session, pairs, self.applier, self.device, self.deadline,
                                           problems):  # fmt: skip
            yield taker.rename(wire), tensor
        self.problem = problems[0] if problems else None
        if self.problem is None:
            for wire in self.empty:  # no piece to wait for: whole already
                yield taker.rename(wire), self.applier.slot(wire)[0]


def _parts(session: Session, me: int) -> Counter[str]:
    return counts(b for (_, dst), cut in session.pairs.pairs.items() if dst == me for b in cut.buckets)


def boxes_into(
    taker: Taker, session: Session, targets: dict[str, Any], atomic: bool, deadline: Deadline
) -> Boxes:
    """``receive_into`` of pair streams: staged in a kept buffer (``atomic``) or straight into the targets'
    boxes."""
    dest = {wire: _slot(targets[taker.rename(wire)]) for wire in session.pairs.order}
    boxes = {w: box for w, (_, box) in dest.items()}
    device = next((t.device for t, _ in dest.values()), taker.device)  # several devices: stage on the first
    names, parts = taker.rename, _parts(session, taker.group.rank)
    if not atomic:  # a target in another dtype than the wire's takes its box apart, then cast in
        wire = {w: dtype_from_name(session.pairs.dtypes[w]) for w in dest}
        streaming = Streaming(taker.copier, names, parts, dest,
                              wire={w: d for w, d in wire.items() if dest[w][0].dtype != d})  # fmt: skip
        return Boxes(taker, session, streaming, device, deadline)
    staged = allocated(taker.group, f"receiving version {session.header.version}", lambda: Staged(
        taker.copier, names, parts, _staging(taker, session.pairs, boxes, device),
        dest=[(w, t, names(w)) for w, (t, _) in dest.items()],
    ))  # fmt: skip
    return Boxes(taker, session, staged, device, deadline)


def boxes_named(
    taker: Taker, session: Session, deadline: Deadline, keep: bool, only: set[str] | None = None,
    every: bool = True,
) -> Boxes:  # fmt: skip
    """``receive()`` of pair streams: whole tensors, each yielded as soon as every piece of it landed, as a
    fan-out stream's are as their buckets land. ``keep``: views of one buffer the receiver keeps, valid
    until the next sync; else tensors of their own. ``only``: the tensors this receiver asked boxes of
    (``receive(reads=...)``), each whole-shaped: the plan brings its box, the rest of it keeps what the
    kept buffer held."""
    plan = session.pairs
    whole = {w: Box((0,) * len(plan.global_shapes[w]), plan.global_shapes[w])
             for w in plan.order if only is None or w in only}  # fmt: skip
    names, parts = taker.rename, _parts(session, taker.group.rank)
    applier: Applier
    if keep:
        applier = allocated(taker.group, f"receiving version {session.header.version}", lambda: Staged(
            taker.copier, names, parts, _staging(taker, plan, whole, taker.device), every=every,
        ))  # fmt: skip
    else:

        def spec(wire: str) -> tuple[torch.dtype, tuple[int, ...], Box]:
            return dtype_from_name(plan.dtypes[wire]), whole[wire].shape, whole[wire]

        applier = Scratch(taker.copier, names, parts, spec, taker.device, every=every)
    empty = tuple(w for w, box in whole.items() if box.numel == 0) if every else ()
    return Boxes(taker, session, applier, taker.device, deadline, empty)
