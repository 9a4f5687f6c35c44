"""What one receive lands, from the streams that feed this receiver (one source's fan-out stream of whole
tensors, or pair streams of boxes), taken by one loop through the applier of its receive mode
(:mod:`._appliers`); :mod:`._receive` runs it, votes and commits alike whatever the plan."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from ..codec import dtype_from_name
from ..control import Deadline
from ..errors import WeightSyncError
from . import _bytes, _delta_sync, _digests
from ._appliers import Applier, Ring, Scratch, Staged, Streaming, counts, fill_aliases, hand_on, wire_typed
from ._delta_sync import Applied, delta_digest, wire_plan
from ._rx_checks import Targets
from ._rx_stream import KEPT, Taker, allocated, tell_failure
from ._session import Session
from ._shard_plan import ShardPlan, element_size
from ._sharded import Slot
from ._sharded_delta import FANOUT, kept_key
from ._streams import Stream
from ._topology import Fanout, Pairs
from ._walk import Feed, Onward, Opened, take
from .manifest import Manifest
from .plan import Plan
from .shard import Box, box_of
from .transports import Landing, stream_device


class Intake:
    """What one receive lands through ``applier``: the ``streams`` that feed this receiver (one source's
    fan-out stream of whole tensors, or pair streams of boxes). :meth:`tensors` yields each tensor (its name
    here; a fan-out's tied names right after it) once whole, then the ones with no byte to wait for
    (``empty``: key, dtype, shape; each a fresh tensor, never a view that would keep a buffer alive), and
    leaves in :attr:`problem` why the bytes are refused (a digest mismatch: this receiver's vote); anything
    else raises. ``tag``: how a fan-out stream's version is kept for the next delta once committed (the kept
    buffer, or the target itself), or None."""

    def __init__(
        self, taker: Taker, session: Session, applier: Applier, deadline: Deadline,
        streams: Callable[[], list[Stream]], *,
        empty: tuple[tuple[Any, torch.dtype, tuple[int, ...]], ...] = (), tag: tuple[Any, ...] | None = None,
        device: torch.device | None = None, total: int | None = None,
    ) -> None:  # fmt: skip
        self.taker, self.session, self.applier, self.deadline = taker, session, applier, deadline
        self.streams_of, self.empty, self.tag = streams, empty, tag
        self.streams: list[Stream] = []
        """The streams that feed this receiver, once the receive begins (a pair's base is begun then)."""
        self.device = device if device is not None else taker.device
        self.total = total if total is not None else applier.total
        """The update's tensors (for the error texts)."""
        self.problem: str | None = None
        self.ready: list[tuple[Any, torch.Tensor]] = []
        """What the applier made whole and this receive has yet to hand on."""

    def tensors(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        manifest, names = self.session.manifest, self.applier.names
        if self.tag is not None:  # what a delta may next be applied to, once this sync commits
            self.taker.memory.bases.adopt(FANOUT, kept_key(self.tag, manifest.digest))
        aliases: dict[Any, list[str]] = {}
        for i, e in enumerate(manifest.entries):
            if e.alias_of is not None:
                aliases.setdefault(manifest.sources[i], []).append(names(i))
        for key, t in self._streams():
            for name in (names(key), *aliases.get(key, [])):
                yield name, t
        for key, dtype, shape in self.empty if self.problem is None else ():  # whole already
            t = torch.empty(shape, dtype=dtype, device=self.device)
            for name in (names(key), *aliases.get(key, [])):
                yield name, t

    def vote(self, check: Callable[[], str | None]) -> None:
        """This receiver's vote is the first problem found; after one, the rest is taken, not applied."""
        if self.problem is None:
            self.problem = check()

    def _streams(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """Every stream part by part (see ``Stream.parts``): a delta's description of the part first (its
        unchanged buckets checked and handed on at once), then every bucket of the part as it lands, from
        whichever stream, in the one order every member walks them; the digests of full streams, when asked
        for, are checked last."""
        self.streams = self.streams_of()
        chained = {s.source for s in self.streams if s.chained}
        digests = _digests.Digests(self.session.header.verify, self.taker.group, chained)
        landers = [_Lander(self, s, digests) for s in self.streams]
        for g in range(max((len(s.parts) for s in self.streams), default=0)):
            feeds: dict[int, list[Feed]] = {}
            for lander in landers:
                part = lander.part(g)
                if part is not None:
                    feeds[lander.stream.source] = part
                yield from hand_on(self.ready)
            yield from self._walk(g, feeds)
        for s in (s for s in self.streams if not s.delta):  # each one's digests taken, whatever was found
            problem = digests.check(s.source, self.deadline, s.feeder)
            self.problem = self.problem or problem

    def _walk(self, g: int, feeds: dict[int, list[Feed]]) -> Iterator[tuple[Any, torch.Tensor]]:
        """Part ``g``'s buckets (``feeds``: by source), each feeder's stream opened over its transport
        (attached in the handshake), passed on where this receiver forwards them."""
        taker, session, me, deadline = self.taker, self.session, self.taker.group.rank, self.deadline
        of = {s.source: s for s in self.streams}  # the stream from each source
        walk = session.topology.walk(me, {s: len(f) for s, f in feeds.items()})
        walks: dict[int, Opened] = {}
        for by in sorted({of[s].feeder for s in feeds}):
            mine = [(s, k) for s, k in walk if of[s].feeder == by]
            if not mine:
                continue
            stream = of[mine[0][0]]
            kind, rx, sync = taker.streams.stream(by, session, deadline)
            wire = Plan.of_sizes([feeds[s][k][0] for s, k in mine])
            if stream.to is None:  # the fan-out: whole buckets land where the applier says
                ring = self.applier.ring
                assert ring is not None
                rx.open(wire, ring.device, replace(sync, part=g))
                land = ring.land(wire) if stream.delta else self.applier.land
            else:
                # A bucket read where it lies (a shared slot) keeps the slot until this receiver comes back to
                # that source's stream; the source may wait for that only when no other receiver's bucket lies
                # between (it has no more receivers than slots), else it could wait on a later bucket: then
                # copy out first.
                assert isinstance(session.topology, Pairs)
                receivers = session.topology.fans.get(by, 0)
                landing = (
                    Landing.SCRATCH if receivers <= getattr(sync.options, "slots", 0) else Landing.STAGING
                )
                ring = Ring(taker.buffers, stream_device(kind, self.device), f"recv{by}-")
                rx.open(wire, ring.device, replace(sync, part=g, to=(me,) * len(mine)))
                land = ring.land(wire, landing)
            ring.size = rx.scratch_buffers
            walks[by] = rx.buckets(wire, land, deadline)
        onward = Onward(taker.group, session.topology.forwards(me), walk, feeds, deadline, self.device)
        try:
            for (src, k), (_, view, in_place) in zip(
                walk, take(walks, (of[s].feeder for s, _ in walk)), strict=True
            ):
                onward.post(src, view)
                feeds[src][k][1](view, in_place)
                yield from hand_on(self.ready)
            onward.finish()
        except BaseException:  # what it was passing on goes now, not when the error (and this frame) does
            onward.close()
            raise


class _Lander:
    """One stream's buckets on this receiver, part by part: checked, kept in its base (a pair's, when kept),
    landed through the applier (what it makes whole goes to the intake's ``ready``). A delta is applied where
    the version held lies: a pair's base, or a fan-out's tensors as its applier holds them (``held``)."""

    def __init__(self, intake: Intake, stream: Stream, digests: _digests.Digests) -> None:
        self.intake, self.stream, self.digests = intake, stream, digests
        self.applier, self.cut = intake.applier, stream.cut
        fanout = stream.to is None
        self.held = self.applier.held if fanout else self._base
        self.put = self.applier.write_back if fanout else None
        self.in_place = fanout
        """A delta's bucket is applied where the applier holds it: nothing to unpack afterwards."""

    def part(self, g: int) -> list[Feed] | None:
        """Part ``g``'s buckets to take (a delta's changed ones, as its source announced them; its unchanged
        ones are checked and landed at once), or None when the stream has no such part."""
        s, intake = self.stream, self.intake
        if g >= len(s.parts):
            return None
        a, b = s.parts[g]
        if not s.delta:
            return [
                (end - start, partial(self.full, k)) for k, (start, end) in enumerate(s.cut.bounds[a:b], a)
            ]
        group, header = intake.taker.group, intake.session.header
        words = s.word_counts(a, b)
        desc = _delta_sync.announced(group, s.source, s.to is None, words, intake.deadline)
        wplan, changed = wire_plan(desc, list(s.words[a:b]), words)
        what = f"version {header.version} from rank {s.source}"
        applied = Applied(desc, self.cut, list(s.words), delta_digest(header), group, self.applier.copier.run,
                          lambda k: f"bucket {k} of {what}", base=self.held, land=self._land, put=self.put,
                          first=a)  # fmt: skip
        for k in range(a, b):
            if k - a not in changed:
                intake.vote(partial(applied.unchanged, k))
        return [
            (end - start, partial(self._changed, applied, a + k, j))
            for j, (k, (start, end)) in enumerate(zip(changed, wplan.bounds, strict=True))
        ]

    def full(self, k: int, view: torch.Tensor, in_place: bool) -> None:
        self.digests.take(view, self.stream.source)
        if self.stream.base is not None:
            self.applier.copier.copy(self._base(k), view)
        self.intake.ready += self.applier.landed(self.cut.buckets[k], view, in_place)

    def _land(self, k: int, view: torch.Tensor, moved: set[Any]) -> None:
        """Bucket k after its delta: ``moved``, the tensors whose bytes it changed."""
        self.intake.ready += self.applier.landed(self.cut.buckets[k], view, self.in_place, moved)

    def _changed(self, applied: Applied, k: int, j: int, payload: torch.Tensor, in_place: bool) -> None:
        self.intake.vote(partial(applied.changed, k, j, payload))

    def _base(self, k: int) -> torch.Tensor:
        assert self.stream.base is not None
        return self.stream.base[slice(*self.cut.bucket_range(k))]


def pair_streams(taker: Taker, session: Session, device: torch.device) -> list[Stream]:
    """This receiver's pair streams, with bases when any source keeps them (each source's header says whether
    its pairs may be deltas), begun as the receive begins."""
    bases = taker.memory.bases if any(h.keeps_base for h in session.headers.values()) else None
    if bases is None:
        taker.memory.bases.clear()  # the senders keep none: nothing to apply a delta to, memory back
    return session.streams(taker.group.rank, False, bases, device)


def _namer(manifest: Manifest, rename: Callable[[str], str]) -> Callable[[Any], str]:
    return lambda i: rename(manifest.entries[i].name)


def _kept(
    buffer: torch.Tensor, plan: Plan, manifest: Manifest, kept: _bytes.Kept | None = None
) -> dict[int, tuple[torch.Tensor, None]]:
    """Each tensor's view of the kept buffer, laid out as the plan lays out its bytes (with ``kept``: the
    same views while the plan, the manifest and the buffer are)."""

    def views() -> dict[int, tuple[torch.Tensor, None]]:
        return {
            i: (_bytes.typed_view(buffer, plan.offsets[i], dtype_from_name(e.wire_dtype), e.shape), None)
            for i, e in enumerate(manifest.entries)
            if e.alias_of is None
        }

    if kept is None:
        return views()
    return kept.get(plan, "kept", (_bytes.address(buffer), manifest.digest), views)


def _fanout_named(taker: Taker, session: Session, deadline: Deadline, every: bool, keep: bool) -> Intake:
    """``receive()``: views of the kept buffer (``keep``, or a source that keeps a base), else tensors of
    their own (or views of the ring); ``every=False``: a delta yields only the tensors it changed."""
    header, manifest = session.header, session.manifest
    plan = session.fanout
    ring = Ring(taker.buffers, taker.device)
    names, parts = _namer(manifest, taker.rename), counts(plan.buckets)
    kept = taker.buffers.kept

    def staged() -> Applier:
        buffer = taker.buffers.get(KEPT, plan.total_bytes, taker.device)
        slots = _kept(buffer, plan, manifest, kept)
        return Staged(
            taker.copier, names, parts, slots, buffer=buffer, plan=plan, ring=ring, every=every, kept=kept
        )

    def spec(i: int) -> tuple[torch.dtype, tuple[int, ...], None]:
        e = manifest.entries[i]
        return dtype_from_name(e.wire_dtype), e.shape, None

    applier = (
        allocated(taker.group, f"receiving version {header.version}", staged)
        if header.keeps_base or keep
        else Scratch(
            taker.copier, names, parts, spec, taker.device, views=True, plan=plan, ring=ring, kept=kept
        )
    )
    entries = manifest.entries if every else ()
    empty = tuple((i, *spec(i)[:2]) for i, e in enumerate(entries) if e.alias_of is None and not e.nbytes)
    streams = partial(session.streams, taker.group.rank, False, None, taker.device)
    return Intake(taker, session, applier, deadline, streams, empty=empty,
                  tag=("receive",) if header.keeps_base else None, total=len(manifest.entries))  # fmt: skip


def _fanout_into(
    taker: Taker, session: Session, targets: dict[str, torch.Tensor], atomic: bool, deadline: Deadline,
    keep: tuple[Any, ...],
) -> Intake:  # fmt: skip
    """``receive_into``: staged in the kept buffer and copied into ``targets`` at the commit (``atomic``),
    or written bucket by bucket into them; ``keep`` tags the base a delta may next be applied to."""
    header, manifest = session.header, session.manifest
    what = f"receiving version {header.version}"
    plan = session.fanout
    entries = manifest.entries
    dest: list[torch.Tensor] = _found(taker, targets, [e.name for e in entries], what)
    device = next((d.device for d in dest), taker.device)
    ring = Ring(taker.buffers, device)
    names, parts = _namer(manifest, taker.rename), counts(plan.buckets)
    typed = [wire_typed(d, e) for d, e in zip(dest, entries, strict=True)]

    def staged() -> Applier:
        buffer = taker.buffers.get(KEPT, plan.total_bytes, device)
        pairs = [(manifest.sources[i], d, names(i)) for i, d in enumerate(dest)]
        kept = taker.buffers.kept
        slots = _kept(buffer, plan, manifest, kept)
        return Staged(taker.copier, names, parts, slots, buffer=buffer, dest=pairs,
                      only_changed=session.delta, plan=plan, ring=ring, kept=kept)  # fmt: skip

    def streaming() -> Applier:
        own = {i: (d, None) for i, (d, e) in enumerate(zip(dest, entries, strict=True)) if e.alias_of is None}
        wire = {i: dtype_from_name(entries[i].wire_dtype) for i in own if not typed[i]}
        flat = [d if t else None for d, t in zip(dest, typed, strict=True)]
        return Streaming(
            taker.copier, names, parts, own, wire=wire, flat=flat,
            tied=lambda only: [names(i) for i in fill_aliases(manifest, dest, only)], delta=session.delta,
            plan=plan, ring=ring, kept=taker.buffers.kept,
        )  # fmt: skip

    applier = allocated(taker.group, what, staged if atomic else streaming)
    kept = header.keeps_base and (atomic or all(typed))
    streams = partial(session.streams, taker.group.rank, False, None, device)
    return Intake(taker, session, applier, deadline, streams, tag=keep if kept else None, total=len(entries))


def _found(taker: Taker, targets: Mapping[str, Any], wire: list[str], what: str) -> list[Any]:
    """The targets of these names on the wire; one missing (only possible when ``expected=`` differs from the
    target) fails the sync, the peers told."""
    missing = [taker.rename(n) for n in wire if taker.rename(n) not in targets]
    if missing:
        err = WeightSyncError(f"target has no tensor named {', '.join(missing[:20])}")
        tell_failure(taker.group, err, what)
        raise err
    return [targets[taker.rename(n)] for n in wire]


def _slot(value: Any) -> Slot:
    """Where a target holds its box of the global tensor."""
    shard = box_of(value)
    if shard is not None:
        return shard.tensor, shard.box
    return value, Box((0,) * value.dim(), tuple(value.shape))


def _staging(
    taker: Taker, plan: ShardPlan, boxes: Mapping[str, Box], device: torch.device, kind: str
) -> tuple[dict[str, Slot], torch.Tensor]:
    """One kept buffer (pre-touched after the first sync) holding every wanted box, one view per tensor; and
    the buffer. The views are kept while the plan, the ``kind`` of receive and the buffer are the same: the
    boxes are the plan's (the wants this receiver posted, from its targets or what it asked for)."""

    def layout() -> tuple[dict[str, int], int]:
        offsets, pos = {}, 0
        for wire in (w for w in plan.order if w in boxes):
            offsets[wire] = pos
            pos += -(-boxes[wire].numel * element_size(plan.dtypes[wire]) // 16) * 16
        return offsets, pos

    offsets, pos = taker.buffers.kept.get(plan, f"offsets-{kind}", len(boxes), layout)
    buffer = taker.buffers.get(KEPT, pos, device)

    def views() -> dict[str, Slot]:
        return {
            wire: (
                _bytes.typed_view(buffer, offsets[wire], dtype_from_name(plan.dtypes[wire]), box.shape),
                box,
            )
            for wire, box in boxes.items()
        }

    at = (_bytes.address(buffer), len(boxes))
    return taker.buffers.kept.get(plan, f"staging-{kind}", at, views), buffer


def _parts(taker: Taker, session: Session, me: int) -> Counter[str]:
    """How many pieces of each tensor reach receiver ``me`` (a copy: the applier counts them down)."""
    plan = session.pairs
    return Counter(taker.buffers.kept.get(plan, "parts", me, lambda: counts(
        b for (_, dst), cut in plan.pairs.items() if dst == me for b in cut.buckets
    )))  # fmt: skip


def _boxes_into(taker: Taker, session: Session, targets: Targets, atomic: bool, deadline: Deadline) -> Intake:
    """``receive_into`` of pair streams: staged in a kept buffer (``atomic``) or straight into the targets'
    boxes."""
    what, order = f"receiving version {session.header.version}", session.pairs.order

    def slots() -> tuple[dict[str, Slot], dict[str, Box], list[tuple[str, torch.Tensor, str]]]:
        dest = dict(zip(order, map(_slot, _found(taker, targets.named, list(order), what)), strict=True))
        boxes = {w: box for w, (_, box) in dest.items()}
        return dest, boxes, [(w, t, taker.rename(w)) for w, (t, _) in dest.items()]

    # the same while the target and the plan are (a repeat sync's): looked up, not walked again
    dest, boxes, pairs = targets.slots(session.pairs, slots)
    device = next((t.device for t, _ in dest.values()), taker.device)  # several devices: stage on the first
    names, parts = taker.rename, _parts(taker, session, taker.group.rank)
    if not atomic:  # a target in another dtype than the wire's takes its box apart, then cast in
        wire = {w: dtype_from_name(session.pairs.dtypes[w]) for w in dest}
        streaming = Streaming(taker.copier, names, parts, dest,
                              wire={w: d for w, d in wire.items() if dest[w][0].dtype != d},
                              kept=taker.buffers.kept)  # fmt: skip
        return Intake(
            taker, session, streaming, deadline, partial(pair_streams, taker, session, device), device=device
        )

    def stage() -> Staged:
        staging, buffer = _staging(taker, session.pairs, boxes, device, "into")
        return Staged(taker.copier, names, parts, staging, buffer=buffer, kept=taker.buffers.kept, dest=pairs)

    staged = allocated(taker.group, what, stage)
    return Intake(
        taker, session, staged, deadline, partial(pair_streams, taker, session, device), device=device
    )


def _boxes_named(
    taker: Taker, session: Session, deadline: Deadline, keep: bool, only: set[str] | None = None,
    every: bool = True,
) -> Intake:  # fmt: skip
    """``receive()`` of pair streams: whole tensors, each yielded as soon as every piece of it landed, as a
    fan-out stream's are as their buckets land. ``keep``: views of one buffer the receiver keeps, valid
    until the next sync; else tensors of their own. ``only``: the tensors this receiver asked boxes of
    (``receive(reads=...)``), each whole-shaped: the plan brings its box, the rest of it keeps what the
    kept buffer held."""
    plan = session.pairs
    whole = {w: Box((0,) * len(plan.global_shapes[w]), plan.global_shapes[w])
             for w in plan.order if only is None or w in only}  # fmt: skip
    names, parts = taker.rename, _parts(taker, session, taker.group.rank)
    applier: Applier
    if keep:

        def stage() -> Staged:
            slots, buffer = _staging(taker, plan, whole, taker.device, "named")
            return Staged(
                taker.copier, names, parts, slots, buffer=buffer, every=every, kept=taker.buffers.kept
            )

        applier = allocated(taker.group, f"receiving version {session.header.version}", stage)
    else:

        def spec(wire: str) -> tuple[torch.dtype, tuple[int, ...], Box]:
            return dtype_from_name(plan.dtypes[wire]), whole[wire].shape, whole[wire]

        applier = Scratch(
            taker.copier, names, parts, spec, taker.device, every=every, kept=taker.buffers.kept
        )
    empty = tuple((w, dtype_from_name(plan.dtypes[w]), b.shape) for w, b in whole.items() if not b.numel)
    streams = partial(pair_streams, taker, session, taker.device)
    return Intake(taker, session, applier, deadline, streams, empty=empty if every else ())


def intake_named(
    taker: Taker, session: Session, deadline: Deadline, every: bool, keep: bool, only: set[str] | None
) -> Intake:
    """``receive()``'s intake, by the sync's topology: whole tensors as a fan-out stream's buckets land or
    as every piece of a tensor landed from the pairs (see the two builders); ``only``: the tensors a pair
    receiver asked boxes of."""
    if isinstance(session.topology, Fanout):
        return _fanout_named(taker, session, deadline, every, keep)
    return _boxes_named(taker, session, deadline, keep, only, every)


def intake_into(
    taker: Taker,
    session: Session,
    targets: Targets,
    atomic: bool,
    deadline: Deadline,
    keep: tuple[Any, ...],
) -> Intake:
    """``receive_into``'s intake, by the sync's topology (see the two builders); ``keep`` tags the base a
    fan-out delta may next be applied to."""
    if isinstance(session.topology, Fanout):
        return _fanout_into(taker, session, targets.named, atomic, deadline, keep)
    return _boxes_into(taker, session, targets, atomic, deadline)
