"""The intake of pair streams (a many-source sync, or boxes, see :mod:`._sharded`): what a receiver wants,
the walk of its streams, where the pieces land. It runs through :mod:`._receive` as a fan-out stream's
intake does."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from ..codec import dtype_from_name, dtype_name
from ..control import Deadline
from ..stateless import StatelessGroup
from . import _bytes, _delta, _delta_sync
from ._appliers import copy_staged, torn
from ._copier import Copier
from ._delta_sync import Description, delta_digest, wire_plan
from ._receive import Intake
from ._rx_stream import KEPT, RxStreams, Taker, allocated
from ._session import Session
from ._shard_plan import Piece, ShardPlan, element_size
from ._sharded import Exchange, Slot, piece_parts
from ._sharded_delta import bucket_word
from ._walk import Feed, Onward, take, walk_of
from .plan import Plan
from .shard import Box, Shard, box_of
from .transports import Landed, Landing, stream_device

__all__ = ["Boxes", "boxes_into", "boxes_named", "data_ptr", "receive_shards", "wants_of"]


class Arrivals:
    """Which of a receiver's tensors have every piece landed (from every source), and which changed: a
    tensor is handed on as soon as it is whole, whatever order the sources' streams deliver it in."""

    def __init__(self, session: Session, me: int) -> None:
        cuts = [cut for (_, dst), cut in session.pairs.pairs.items() if dst == me]
        self.left: Counter[str] = Counter(p.name for cut in cuts for b in cut.buckets for p in b)
        self.changed: set[str] = set()
        self.touched: dict[str, None] = {}
        """The tensors some piece of which is being or was written, in the order they first were."""
        self._ready: list[str] = []

    def landing(self, pieces: Sequence[Piece]) -> None:
        """These pieces are about to be written (a copy that fails midway leaves them partly written)."""
        self.touched.update(dict.fromkeys(p.name for p in pieces))

    def landed(self, pieces: Sequence[Piece], changed: Sequence[bool]) -> None:
        for p, moved in zip(pieces, changed, strict=True):
            if moved:
                self.changed.add(p.name)
            self.left[p.name] -= 1
            if self.left[p.name] == 0:
                self._ready.append(p.name)

    def take(self) -> list[str]:
        """The tensors that became whole since the last call, in the order they did."""
        ready, self._ready = self._ready, []
        return ready


def receive_shards(x: Exchange, streams: RxStreams, arrivals: Arrivals, problems: list[str]) -> Iterator[str]:
    """This receiver's part of step 3: land every source's pieces in its slots (keyed by wire name). Each
    source's buckets come over its pair transport (attached in the handshake), read in the order every
    member walks them: round, turn (see ``Session.turns``), source. Yields each tensor's wire name as it
    becomes whole (every piece of it landed); why the bytes are refused (a digest mismatch) goes to
    ``problems``."""
    group, session = x.group, x.session
    digests = _bytes.Digests(session.header.verify, group)
    checked: list[int] = []
    plan, me = session.pairs, group.rank
    feeds: dict[int, list[Feed]] = {}
    for pair in x.pairs(sending=False):
        src, cut = pair.peer, pair.cut
        lander = _Lander(group, session, src, cut, x.slots, x.copier, pair.base, problems, arrivals, digests)
        if pair.delta:
            feeds[src] = lander.delta(x.deadline)
            yield from arrivals.take()  # its unchanged buckets were unpacked from the base
        else:
            feeds[src] = [(end - start, partial(lander.full, k)) for k, (start, end) in enumerate(cut.bounds)]
            checked.append(src)
    walk = walk_of(session, me, {s: len(f) for s, f in feeds.items()})
    walks: dict[int, Iterator[tuple[int, torch.Tensor, bool]]] = {}
    for feeder in sorted({plan.feeder(s, me) for s in feeds}):
        mine = [(s, k) for s, k in walk if plan.feeder(s, me) == feeder]
        kind, rx, sync = streams.stream(feeder, session, x.deadline)
        device = stream_device(kind, x.device)
        wire = Plan.of_sizes([feeds[s][k][0] for s, k in mine])
        rx.open(wire, device, replace(sync, to=(me,) * len(mine)))
        # A bucket read where it lies (a shared slot) keeps the slot until this receiver comes back to that
        # source's stream; the source may wait for that only when no other receiver's bucket lies between
        # (it has no more receivers than slots), else it could wait on a later bucket: then copy out first.
        receivers = sum(1 for s, _ in plan.pairs if s == feeder)
        slots = getattr(sync.options, "slots", 0)
        landing = Landing.SCRATCH if receivers <= slots else Landing.STAGING
        land = partial(_land, x.buffers, f"recv{feeder}", rx.scratch_buffers, wire, landing, device)
        walks[feeder] = rx.buckets(wire, land, x.deadline)
    onward = Onward(group, plan, walk, feeds, x.deadline, x.device)
    for (src, k), (_, view, _) in zip(walk, take(walks, (plan.feeder(s, me) for s, _ in walk)), strict=True):
        onward.post(src, view)
        feeds[src][k][1](view)
        yield from arrivals.take()
    onward.finish()
    for src in checked:
        problem = digests.check(src, x.deadline)
        if problem is not None:
            problems.append(problem)


def _land(
    buffers: _bytes.BufferCache, name: str, ring: int, plan: Plan, kind: Landing, device: torch.device, k: int
) -> Landed:
    """Where a pair's bucket lands: the receiver's own buffer on ``device`` (a ring per source); SCRATCH
    lets a transport with a shared slot hand out the slot itself instead."""
    start, end = plan.bucket_range(k)
    return Landed(buffers.get(f"{name}-{k % ring}", end - start, device), kind)


class _Lander:
    """One pair's buckets on its receiver: checked, kept in the base (when kept), unpacked into the slots."""

    def __init__(
        self,
        group: StatelessGroup,
        session: Session,
        src: int,
        cut: Plan[Piece],
        slots: Mapping[str, Slot],
        copier: Copier,
        base: torch.Tensor | None,
        problems: list[str],
        arrivals: Arrivals,
        digests: _bytes.Digests,
    ) -> None:
        self.group, self.session, self.src, self.cut = group, session, src, cut
        self.slots, self.copier, self.base = slots, copier, base
        self.problems, self.arrivals, self.digests = problems, arrivals, digests

    def _unpack(self, k: int, view: torch.Tensor, changed: Sequence[bool] | None = None) -> None:
        """Bucket k's pieces into the slots; ``changed`` (per piece; None: all) says which of them moved."""
        pieces = self.cut.buckets[k]
        for p in pieces:  # a slot made on demand is made here, on this thread (its device is this thread's)
            self.slots[p.name]
        self.arrivals.landing(pieces)
        self.copier.run(partial(_unpack, pieces, view, self.slots, self.session.pairs))
        self.arrivals.landed(pieces, changed if changed is not None else [True] * len(pieces))

    def full(self, k: int, buf: torch.Tensor) -> None:
        self.digests.take(buf, self.src)
        if self.base is not None:
            self.copier.copy(self._view(k), buf)
        self._unpack(k, buf)

    def delta(self, deadline: Deadline) -> list[tuple[int, Callable[[torch.Tensor], None]]]:
        """The pair's changed buckets to receive (as its source announced them), each applied to the base
        then unpacked; the unchanged ones are checked and unpacked from the base at once."""
        plan = self.session.pairs
        cut = self.cut
        sizes = [bucket_word(b, plan.dtypes) for b in cut.buckets]
        words = [(end - start) // w for (start, end), w in zip(cut.bounds, sizes, strict=True)]
        desc = _delta_sync.announced(self.group, self.src, False, words, deadline)
        wplan, changed = wire_plan(desc, sizes, words)
        for k, pieces in enumerate(cut.buckets):
            if k not in changed:
                self._check(k, desc, [False] * len(pieces))
        out: list[tuple[int, Callable[[torch.Tensor], None]]] = []
        for j, k in enumerate(changed):
            start, end = wplan.bucket_range(j)
            out.append((end - start, partial(self._apply, k, j, desc)))
        return out

    def _view(self, k: int) -> torch.Tensor:
        assert self.base is not None
        return self.base[slice(*self.cut.bucket_range(k))]

    def _check(self, k: int, desc: Description, changed: Sequence[bool]) -> None:
        what = f"bucket {k} from rank {self.src}"
        problem = _delta_sync.check(
            self._view(k), desc, k, delta_digest(self.session.header), self.group, what
        )
        if problem is not None:
            self.problems.append(problem)
            return
        self._unpack(k, self._view(k), changed)

    def _apply(self, k: int, j: int, desc: Description, payload: torch.Tensor) -> None:
        w = bucket_word(self.cut.buckets[k], self.session.pairs.dtypes)
        moved, problem = _delta_sync.apply(
            self._view(k), payload, desc, k, j, w, delta_digest(self.session.header), self.group,
            self.copier.run, f"bucket {k} from rank {self.src}",
        )  # fmt: skip
        if moved is None:
            assert problem is not None
            self.problems.append(problem)
            return
        self._unpack(
            k,
            self._view(k),
            _delta.spans_hit(moved, [(p.offset, p.nbytes) for p in self.cut.buckets[k]], w),
        )


def _unpack(pieces: tuple[Piece, ...], buf: torch.Tensor, slots: Mapping[str, Slot], plan: ShardPlan) -> None:
    _bytes.unpack_parts(buf, piece_parts(pieces, slots, plan.dtypes))


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
    shard = box_of(t)
    return (shard.tensor if shard is not None else t).data_ptr()


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


def _device_of(tensors: list[torch.Tensor], default: torch.device) -> torch.device:
    """Where a receiver's targets are (its staging, landing buffers and bases go there too); targets on
    several devices stage on the first one's."""
    return tensors[0].device if tensors else default


class Boxes(Intake):
    """Pair streams' pieces landed in ``slots`` (by wire name): a kept staging buffer, the target's own boxes,
    or tensors made as their first piece lands (:class:`_Fresh`). With ``wanted`` (``receive()``: the boxes
    asked for, by wire name) each tensor is yielded (renamed) once every piece of it landed, from whichever
    sources hold it, and let go here (``every=False``: only those a delta changed). ``dest``: the targets'
    boxes the staged ones are copied into at the commit (atomic); ``streaming``: the slots are the targets',
    so what lands is written."""

    def __init__(
        self, taker: Taker, session: Session, slots: dict[str, Slot], device: torch.device,
        deadline: Deadline, *, wanted: Mapping[str, Box] | None = None, every: bool = True,
        dest: dict[str, Slot] | None = None, streaming: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(len(wanted) if wanted is not None else len(dest or slots))
        self.taker, self.session, self.slots, self.device = taker, session, slots, device
        self.deadline, self.wanted = deadline, wanted
        self.every, self.dest, self.streaming = every, dest, streaming
        self.arrivals = Arrivals(session, taker.group.rank)

    def written(self) -> list[str]:
        """Streaming: every tensor some piece of which landed (in the target itself)."""
        return [self.taker.rename(w) for w in self.arrivals.touched] if self.streaming else []

    def tensors(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        taker, session, slots = self.taker, self.session, self.slots
        # bases when any source keeps them (each source's header says whether its pairs may be deltas)
        bases = taker.memory.bases if any(h.keeps_base for h in session.headers.values()) else None
        if bases is None:
            taker.memory.bases.clear()  # the senders keep none: nothing to apply a delta to, memory back
        x = Exchange(taker.group, session, slots, taker.copier, taker.buffers, self.deadline, self.device,
                     bases)  # fmt: skip
        problems: list[str] = []
        wanted = self.wanted if self.wanted is not None else {}
        for wire in receive_shards(x, taker.streams, self.arrivals, problems):
            if wire not in wanted:
                continue
            tensor = slots.pop(wire)[0]  # no piece of it is left to land: let go here
            if self.every or wire in self.arrivals.changed:
                yield taker.rename(wire), tensor
        self.problem = problems[0] if problems else None
        if self.every and self.problem is None:
            for wire, box in wanted.items():  # no piece to wait for (empty tensors): whole already
                if box.numel == 0:
                    yield taker.rename(wire), slots[wire][0]

    def commit(self) -> None:
        dest = self.dest
        if dest is not None:
            staged = ((dest[wire][0], tensor) for wire, (tensor, _) in self.slots.items())
            copy_staged(self.taker.copier, staged)

    def commit_failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        names = [self.taker.rename(w) for w in self.dest or ()]
        return torn(version, held, cause, names, len(names), "every byte arrived")

    def kept(self) -> None:
        self.taker.memory.bases.commit(self.session.header.version)  # every pair's base holds it now

    def abandon(self) -> None:
        self.taker.memory.bases.abandon()


def boxes_into(
    taker: Taker, session: Session, targets: dict[str, Any], atomic: bool, deadline: Deadline
) -> Boxes:
    """``receive_into`` of pair streams: staged in a kept buffer (``atomic``) or straight into the targets'
    boxes."""
    dest = {wire: _slot(targets[taker.rename(wire)]) for wire in session.pairs.order}
    boxes = {w: box for w, (_, box) in dest.items()}
    device = _device_of([t for t, _ in dest.values()], taker.device)
    taker.memory.held = None
    if not atomic:
        return Boxes(taker, session, dict(dest), device, deadline, streaming=True)
    slots = allocated(taker.group, f"receiving version {session.header.version}",
                      lambda: _staging(taker, session.pairs, boxes, device))  # fmt: skip
    return Boxes(taker, session, slots, device, deadline, dest=dest)


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

    taker.memory.held = None
    slots = (
        allocated(taker.group, f"receiving version {session.header.version}",
                  lambda: _staging(taker, plan, whole, taker.device))
        if keep
        else _Fresh(whole, plan.dtypes, taker.device)
    )  # fmt: skip
    return Boxes(taker, session, slots, taker.device, deadline, wanted=whole, every=every)


class _Fresh(dict[str, Slot]):
    """``receive()`` without ``keep``: each tensor made when its first piece lands and let go here once its
    last did (yielded, unless a delta left it as it was): the receiver holds the tensors whose pieces are
    still in flight, not a whole model made up front, and what it yielded is the consumer's alone."""

    def __init__(self, boxes: Mapping[str, Box], dtypes: Mapping[str, str], device: torch.device) -> None:
        super().__init__()
        self.boxes, self.dtypes, self.device = boxes, dtypes, device

    def __missing__(self, wire: str) -> Slot:
        box = self.boxes[wire]
        dtype = dtype_from_name(self.dtypes[wire])
        self[wire] = slot = (torch.empty(box.shape, dtype=dtype, device=self.device), box)
        return slot
