"""What one receive lands, from the streams that feed this receiver (one source's fan-out stream of whole
tensors, or pair streams of boxes), through the applier of its receive mode (:mod:`._appliers`);
:mod:`._receive` runs it, votes and commits alike whatever the plan."""

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
from ..stateless import StatelessGroup
from . import _bytes, _delta_sync
from ._appliers import Applier, Ring, Scratch, Staged, Streaming, counts, fill_aliases, hand_on, wire_typed
from ._delta_sync import Applied, delta_digest, delta_groups, wire_plan, word_counts
from ._rx_stream import KEPT, Taker, allocated, tell_failure
from ._session import Session, merged_plan
from ._shard_plan import Piece, ShardPlan, element_size
from ._sharded import Pair, Slot, pairs_of
from ._sharded_delta import FANOUT, bucket_word, kept_key
from ._walk import Feed, Onward, take, walk_of
from .manifest import Manifest
from .plan import Plan
from .shard import Box, box_of
from .transports import Landing, stream_device


class Intake:
    """What one receive lands through ``applier``: the fan-out stream cut by ``plan``, or (``plan`` None) this
    receiver's pair streams. :meth:`tensors` yields each tensor (its name here; a fan-out's tied names right
    after it) once whole, then the ones with no byte to wait for (``empty``: key, dtype, shape; each a fresh
    tensor, never a view that would keep a buffer alive), and leaves in :attr:`problem`
    why the bytes are refused (a digest mismatch: this receiver's vote); anything else raises. ``tag``: how
    a fan-out stream's version is kept for the next delta once committed (the kept buffer, or the target
    itself), or None."""

    def __init__(
        self, taker: Taker, session: Session, applier: Applier, deadline: Deadline, *,
        plan: Plan | None = None, empty: tuple[tuple[Any, torch.dtype, tuple[int, ...]], ...] = (),
        tag: tuple[Any, ...] | None = None,
        device: torch.device | None = None,
    ) -> None:  # fmt: skip
        self.taker, self.session, self.applier, self.deadline = taker, session, applier, deadline
        self.plan, self.empty, self.tag = plan, empty, tag
        self.device = device if device is not None else taker.device
        self.total = len(session.manifest.entries) if plan is not None else applier.total
        """The update's tensors (for the error texts)."""
        self.problem: str | None = None

    def tensors(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        session, names = self.session, self.applier.names
        aliases: dict[Any, list[str]] = {}
        if self.plan is None:
            whole = self._pairs()
        else:
            manifest = session.manifest
            if self.tag is not None:  # what a delta may next be applied to, once this sync commits
                self.taker.memory.bases.adopt(FANOUT, kept_key(self.tag, manifest.digest))
            for i, e in enumerate(manifest.entries):
                if e.alias_of is not None:
                    aliases.setdefault(manifest.sources[i], []).append(names(i))
            whole = self._delta() if session.delta else self._full()
        for key, t in whole:
            for name in (names(key), *aliases.get(key, [])):
                yield name, t
        for key, dtype, shape in self.empty if self.problem is None else ():  # whole already
            t = torch.empty(shape, dtype=dtype, device=self.device)
            for name in (names(key), *aliases.get(key, [])):
                yield name, t

    def _full(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """Every bucket of the fan-out stream as it arrives; the digests, when asked for, are checked last."""
        session, applier, deadline, plan = self.session, self.applier, self.deadline, self.plan
        src = session.src
        assert plan is not None and applier.ring is not None
        _, rx, sync = self.taker.streams.stream(src, session, deadline)
        rx.open(plan, applier.ring.device, sync)
        applier.ring.size = rx.scratch_buffers
        digests = _bytes.Digests(session.header.verify, self.taker.group)
        landed = rx.buckets(plan, applier.land, deadline)
        for k, view, in_place in take({src: landed}, [src] * len(plan.buckets)):
            digests.take(view, src)
            yield from hand_on(applier.landed(plan.buckets[k], view, in_place))
        self.problem = digests.check(src, deadline)

    def _delta(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """The delta (see :mod:`._delta_sync`), group by group, each bucket checked or applied where the
        applier holds the version (:class:`._delta_sync.Applied`): the buckets it leaves as they were at
        once, each changed one as it lands. A mismatch takes the rest without applying it (the source is
        still sending) and is this receiver's vote."""
        session, applier, deadline, src = self.session, self.applier, self.deadline, self.session.src
        header, plan, group, ring = session.header, self.plan, self.taker.group, applier.ring
        assert plan is not None and ring is not None
        _, rx, sync = self.taker.streams.stream(src, session, deadline)
        sizes, words = word_counts(plan, session.manifest)
        ready: list[tuple[Any, torch.Tensor]] = []

        def land(k: int, view: torch.Tensor, keys: set[Any]) -> None:
            ready.extend(applier.landed(plan.buckets[k], view, True, keys))

        for a, b in delta_groups(plan):
            desc = _delta_sync.announced(group, src, True, words[a:b], deadline)
            wplan, sources = wire_plan(desc, sizes[a:b], words[a:b])
            applied = Applied(desc, plan, sizes, delta_digest(header), group, self.taker.copier.run,
                              lambda k: f"bucket {k} of version {header.version}", base=applier.held,
                              land=land, put=applier.write_back, first=a)  # fmt: skip
            for k in range(a, b):
                if k - a not in sources and self.problem is None:
                    self.problem = applied.unchanged(k)
                    yield from hand_on(ready)
            if not sources:
                continue
            rx.open(wplan, ring.device, sync)
            sync = sync.next_part()
            ring.size = rx.scratch_buffers
            landed = rx.buckets(wplan, ring.land(wplan), deadline)
            for j, view, _ in take({src: landed}, [src] * len(wplan.buckets)):
                if self.problem is None:  # else the source is still sending: take the rest, apply nothing
                    self.problem = applied.changed(a + sources[j], j, view)
                    yield from hand_on(ready)

    def _pairs(self) -> Iterator[tuple[Any, torch.Tensor]]:
        taker, session = self.taker, self.session
        # bases when any source keeps them (each source's header says whether its pairs may be deltas)
        bases = taker.memory.bases if any(h.keeps_base for h in session.headers.values()) else None
        if bases is None:
            taker.memory.bases.clear()  # the senders keep none: nothing to apply a delta to, memory back
        pairs = pairs_of(session, taker.group.rank, False, bases, self.device)
        problems: list[str] = []
        yield from receive_shards(taker, session, pairs, self.applier, self.device, self.deadline, problems)
        self.problem = problems[0] if problems else None


def receive_shards(
    taker: Taker, session: Session, pairs: list[Pair], applier: Applier, device: torch.device,
    deadline: Deadline, problems: list[str],
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """This receiver's pair streams, each feeder's over its transport (attached in the handshake), in the one
    order every member walks them (:func:`._walk.walk_of`), landed through ``applier`` (keyed by wire name):
    yields each tensor it hands on once whole, from whichever sources; a digest mismatch goes to
    ``problems``."""
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
        self, group: StatelessGroup, session: Session, src: int, cut: Plan[Piece], applier: Applier,
        base: torch.Tensor | None, problems: list[str], ready: list[tuple[str, torch.Tensor]],
        digests: _bytes.Digests,
    ) -> None:  # fmt: skip
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


def plan_of(session: Session, taker: Taker) -> Plan:
    """The session's bucket plan, the merged one when every member agreed to it (reused while the manifest
    and the bucket sizes are unchanged)."""
    if session.merged:
        return merged_plan(session.manifest)
    header = session.header
    return taker.plans.whole(session.manifest, header.bucket_bytes, header.solo_bytes)


def _namer(manifest: Manifest, rename: Callable[[str], str]) -> Callable[[Any], str]:
    return lambda i: rename(manifest.entries[i].name)


def _kept(buffer: torch.Tensor, plan: Plan, manifest: Manifest) -> dict[int, tuple[torch.Tensor, None]]:
    """Each tensor's view of the kept buffer, laid out as the plan lays out its bytes."""
    return {
        i: (_bytes.typed_view(buffer, plan.offsets[i], dtype_from_name(e.wire_dtype), e.shape), None)
        for i, e in enumerate(manifest.entries)
        if e.alias_of is None
    }


def fanout_named(taker: Taker, session: Session, deadline: Deadline, every: bool, keep: bool) -> Intake:
    """``receive()``: views of the kept buffer (``keep``, or a source that keeps a base), else tensors of
    their own (or views of the ring); ``every=False``: a delta yields only the tensors it changed."""
    header, manifest = session.header, session.manifest
    plan = plan_of(session, taker)
    ring = Ring(taker.buffers, taker.device)
    names, parts = _namer(manifest, taker.rename), counts(plan.buckets)

    def staged() -> Applier:
        buffer = taker.buffers.get(KEPT, plan.total_bytes, taker.device)
        return Staged(taker.copier, names, parts, _kept(buffer, plan, manifest), buffer=buffer, plan=plan,
                      ring=ring, every=every)  # fmt: skip

    def spec(i: int) -> tuple[torch.dtype, tuple[int, ...], None]:
        e = manifest.entries[i]
        return dtype_from_name(e.wire_dtype), e.shape, None

    applier = (
        allocated(taker.group, f"receiving version {header.version}", staged)
        if header.keeps_base or keep
        else Scratch(taker.copier, names, parts, spec, taker.device, views=True, plan=plan, ring=ring)
    )
    entries = manifest.entries if every else ()
    empty = tuple((i, *spec(i)[:2]) for i, e in enumerate(entries) if e.alias_of is None and not e.nbytes)
    return Intake(taker, session, applier, deadline, plan=plan, empty=empty,
                  tag=("receive",) if header.keeps_base else None)  # fmt: skip


def fanout_into(
    taker: Taker, session: Session, targets: dict[str, torch.Tensor], atomic: bool, deadline: Deadline,
    keep: tuple[Any, ...],
) -> Intake:  # fmt: skip
    """``receive_into``: staged in the kept buffer and copied into ``targets`` at the commit (``atomic``),
    or written bucket by bucket into them; ``keep`` tags the base a delta may next be applied to."""
    header, manifest = session.header, session.manifest
    what = f"receiving version {header.version}"
    plan = plan_of(session, taker)
    entries = manifest.entries
    dest: list[torch.Tensor] = _found(taker, targets, [e.name for e in entries], what)
    device = next((d.device for d in dest), taker.device)
    ring = Ring(taker.buffers, device)
    names, parts = _namer(manifest, taker.rename), counts(plan.buckets)
    typed = [wire_typed(d, e) for d, e in zip(dest, entries, strict=True)]

    def staged() -> Applier:
        buffer = taker.buffers.get(KEPT, plan.total_bytes, device)
        pairs = [(manifest.sources[i], d, names(i)) for i, d in enumerate(dest)]
        return Staged(taker.copier, names, parts, _kept(buffer, plan, manifest), buffer=buffer, dest=pairs,
                      only_changed=session.delta, plan=plan, ring=ring)  # fmt: skip

    def streaming() -> Applier:
        own = {i: (d, None) for i, (d, e) in enumerate(zip(dest, entries, strict=True)) if e.alias_of is None}
        wire = {i: dtype_from_name(entries[i].wire_dtype) for i in own if not typed[i]}
        flat = [d if t else None for d, t in zip(dest, typed, strict=True)]
        return Streaming(
            taker.copier, names, parts, own, wire=wire, flat=flat,
            tied=lambda only: [names(i) for i in fill_aliases(manifest, dest, only)], delta=session.delta,
            plan=plan, ring=ring,
        )  # fmt: skip

    applier = allocated(taker.group, what, staged if atomic else streaming)
    kept = header.keeps_base and (atomic or all(typed))
    return Intake(taker, session, applier, deadline, plan=plan, tag=keep if kept else None)


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


def _parts(session: Session, me: int) -> Counter[str]:
    return counts(b for (_, dst), cut in session.pairs.pairs.items() if dst == me for b in cut.buckets)


def boxes_into(
    taker: Taker, session: Session, targets: dict[str, Any], atomic: bool, deadline: Deadline
) -> Intake:
    """``receive_into`` of pair streams: staged in a kept buffer (``atomic``) or straight into the targets'
    boxes."""
    what, order = f"receiving version {session.header.version}", session.pairs.order
    dest = dict(zip(order, map(_slot, _found(taker, targets, list(order), what)), strict=True))
    boxes = {w: box for w, (_, box) in dest.items()}
    device = next((t.device for t, _ in dest.values()), taker.device)  # several devices: stage on the first
    names, parts = taker.rename, _parts(session, taker.group.rank)
    if not atomic:  # a target in another dtype than the wire's takes its box apart, then cast in
        wire = {w: dtype_from_name(session.pairs.dtypes[w]) for w in dest}
        streaming = Streaming(taker.copier, names, parts, dest,
                              wire={w: d for w, d in wire.items() if dest[w][0].dtype != d})  # fmt: skip
        return Intake(taker, session, streaming, deadline, device=device)
    staged = allocated(taker.group, what, lambda: Staged(
        taker.copier, names, parts, _staging(taker, session.pairs, boxes, device),
        dest=[(w, t, names(w)) for w, (t, _) in dest.items()],
    ))  # fmt: skip
    return Intake(taker, session, staged, deadline, device=device)


def boxes_named(
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
    empty = tuple((w, dtype_from_name(plan.dtypes[w]), b.shape) for w, b in whole.items() if not b.numel)
    return Intake(taker, session, applier, deadline, empty=empty if every else ())
