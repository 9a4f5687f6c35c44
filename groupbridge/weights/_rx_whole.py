"""The intake of a fan-out stream (one source sending whole tensors to every receiver, see :mod:`._session`):
its buckets, full or a delta, fed as they land to the applier of the receive mode (:mod:`._appliers`). The
intake of pair streams is :class:`._sharded_rx.Boxes`; both run through :mod:`._receive`."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch

from ..codec import dtype_from_name
from ..control import Deadline
from ..errors import WeightSyncError
from . import _bytes, _delta_sync
from ._appliers import Applier, Ring, Scratch, Staged, Streaming, counts, fill_aliases, hand_on, wire_typed
from ._delta_sync import Applied, delta_digest, delta_groups, wire_plan, word_counts
from ._receive import Intake
from ._rx_stream import KEPT, Taker, allocated, tell_failure
from ._session import Session, merged_plan
from ._sharded_delta import FANOUT, kept_key
from ._walk import take
from .manifest import Manifest
from .plan import Plan


def plan_of(session: Session, taker: Taker) -> Plan:
    """The session's bucket plan, the merged one when every member agreed to it (reused while the manifest
    and the bucket sizes are unchanged)."""
    if session.merged:
        return merged_plan(session.manifest)
    header = session.header
    return taker.plans.whole(session.manifest, header.bucket_bytes, header.solo_bytes)


def _namer(manifest: Manifest, rename: Callable[[str], str]) -> Callable[[Any], str]:
    return lambda i: rename(manifest.entries[i].name)


class Fanout(Intake):
    """The stream's buckets through ``applier``: (name, tensor) as each tensor's last bytes land (tied names
    right after their tensor; empty tensors last, with ``every``). ``tag``: how the version is kept for the
    next delta once committed (the kept buffer, or the target itself), or None."""

    def __init__(
        self, taker: Taker, session: Session, plan: Plan, applier: Applier, deadline: Deadline, *,
        every: bool, tag: tuple[Any, ...] | None,
    ) -> None:  # fmt: skip
        super().__init__(applier, len(session.manifest.entries))
        self.taker, self.session, self.plan = taker, session, plan
        self.deadline, self.every, self.tag = deadline, every, tag
        assert applier.ring is not None
        self.ring = applier.ring

    def tensors(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        manifest, names, taker = self.session.manifest, self.applier.names, self.taker
        if self.tag is not None:  # what a delta may next be applied to, once this sync commits
            taker.memory.bases.adopt(FANOUT, kept_key(self.tag, manifest.digest))
        aliases: dict[int, list[str]] = {}
        for i, e in enumerate(manifest.entries):
            if e.alias_of is not None:
                aliases.setdefault(manifest.sources[i], []).append(names(i))
        whole = self._delta() if self.session.delta else self._full()
        for index, t in whole:
            for name in (names(index), *aliases.get(index, [])):
                yield name, t
        for i, e in enumerate(manifest.entries):  # empty tensors have no bytes in any bucket
            if e.alias_of is None and e.nbytes == 0 and self.every and self.problem is None:
                t = torch.empty(e.shape, dtype=dtype_from_name(e.wire_dtype), device=taker.device)
                for name in (names(i), *aliases.get(i, [])):
                    yield name, t

    def _full(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """Every bucket as it arrives; the digests, when the header asks for them, are checked last."""
        session, applier, deadline, src = self.session, self.applier, self.deadline, self.session.src
        _, rx, sync = self.taker.streams.stream(src, session, deadline)
        rx.open(self.plan, self.ring.device, sync)
        self.ring.size = rx.scratch_buffers
        digests = _bytes.Digests(session.header.verify, self.taker.group)
        landed = rx.buckets(self.plan, applier.land, deadline)
        for k, view, in_place in take({src: landed}, [src] * len(self.plan.buckets)):
            digests.take(view, src)
            yield from hand_on(applier.landed(self.plan.buckets[k], view, in_place))
        self.problem = digests.check(src, deadline)

    def _delta(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """The delta (see :mod:`._delta_sync`), group by group, each bucket checked or applied where the
        applier holds the version (:class:`._delta_sync.Applied`): the buckets it leaves as they were at
        once, each changed one as it lands. A mismatch takes the rest without applying it (the source is
        still sending) and is this receiver's vote."""
        session, applier, deadline, src = self.session, self.applier, self.deadline, self.session.src
        header, plan, group = session.header, self.plan, self.taker.group
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
            rx.open(wplan, self.ring.device, sync)
            sync = sync.next_part()
            self.ring.size = rx.scratch_buffers
            landed = rx.buckets(wplan, self.ring.land(wplan), deadline)
            for j, view, _ in take({src: landed}, [src] * len(wplan.buckets)):
                if self.problem is None:  # else the source is still sending: take the rest, apply nothing
                    self.problem = applied.changed(a + sources[j], j, view)
                    yield from hand_on(ready)


def _kept(buffer: torch.Tensor, plan: Plan, manifest: Manifest) -> dict[int, tuple[torch.Tensor, None]]:
    """Each tensor's view of the kept buffer, laid out as the plan lays out its bytes."""
    return {
        i: (_bytes.typed_view(buffer, plan.offsets[i], dtype_from_name(e.wire_dtype), e.shape), None)
        for i, e in enumerate(manifest.entries)
        if e.alias_of is None
    }


def fanout_named(taker: Taker, session: Session, deadline: Deadline, every: bool, keep: bool) -> Fanout:
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
    return Fanout(taker, session, plan, applier, deadline, every=every,
                  tag=("receive",) if header.keeps_base else None)  # fmt: skip


def fanout_into(
    taker: Taker, session: Session, targets: dict[str, torch.Tensor], atomic: bool, deadline: Deadline,
    keep: tuple[Any, ...],
) -> Fanout:  # fmt: skip
    """``receive_into``: staged in the kept buffer and copied into ``targets`` at the commit (``atomic``),
    or written bucket by bucket into them; ``keep`` tags the base a delta may next be applied to."""
    header, manifest = session.header, session.manifest
    what = f"receiving version {header.version}"
    plan = plan_of(session, taker)
    entries = manifest.entries
    found = [targets.get(taker.rename(e.name)) for e in entries]
    missing = [taker.rename(e.name) for e, d in zip(entries, found, strict=True) if d is None]
    if missing:  # only possible when expected= differs from the target
        err = WeightSyncError(f"target has no tensor named {', '.join(missing[:20])}")
        tell_failure(taker.group, err, what)
        raise err
    dest: list[torch.Tensor] = [d for d in found if d is not None]
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
    return Fanout(taker, session, plan, applier, deadline, every=False, tag=keep if kept else None)
