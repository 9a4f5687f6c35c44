"""Where a receive's bytes go, and when a tensor is whole: one family of appliers for every plan.

Each bucket a receiver's streams bring holds parts of tensors, each keyed by its tensor: a ``Segment`` of a
fan-out stream (a byte range, keyed by manifest index) or a ``Piece`` of a pair (a box, keyed by wire name).
An applier keeps each tensor's slot, unpacks a bucket's parts into their slots (nothing to copy where the
bucket landed there) and counts them: a tensor is whole once its last part landed, from whichever stream,
and the receive mode (:class:`Scratch`, :class:`Staged`, :class:`Streaming`) says what that means.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

import torch

from ..codec import dtype_from_name
from ..errors import SyncRefusedError, TornUpdateError, WeightSyncError
from . import _bytes
from ._copier import Copier
from .manifest import Entry, Manifest
from .plan import Plan
from .transports import Land, Landed, Landing

Key = Hashable
"""A tensor of the receive: a manifest index (a fan-out stream), a name on the wire (pairs)."""

Slot = tuple[torch.Tensor, Any]
"""Where a tensor lives on this receiver: the tensor, and (for a box of a global tensor) the box it holds."""


class Part(Protocol):
    """What a bucket holds of one tensor (``plan.Segment``, ``_shard_plan.Piece``)."""

    @property
    def key(self) -> Any: ...

    @property
    def bucket_offset(self) -> int: ...

    def part(self, slot: Any) -> _bytes.Part: ...


def torn(
    version: int, held: int | None, cause: BaseException, written: list[str], total: int, how: str,
    *, subject: str = "the target is TORN", verb: str = "(partly) written",
) -> TornUpdateError:  # fmt: skip
    """The one wording of a torn update: what failed, which tensors were written (for ``receive()``:
    yielded, and what is torn is whatever consumed them), which version is held."""
    shown = ", ".join(written[:20]) + (f" ... and {len(written) - 20} more" if len(written) > 20 else "")
    return TornUpdateError(
        f"receiving version {version} failed after {how}: {type(cause).__name__}: {cause}; {subject}: "
        f"{len(written)} of {total} tensors were {verb} ({shown or 'none'}); the version held is still "
        f"{held}",
        written=written,
    )


def refused(
    version: int, held: int | None, cause: BaseException, written: list[str], total: int, *,
    yielded: bool = False,
) -> WeightSyncError:  # fmt: skip
    """The error of a receiver when the sync failed at or before the vote: torn when it wrote (or, for
    ``receive()``: ``yielded``) some tensors already, else untouched. A :class:`SyncRefusedError` that every
    member raised stays one (the group is usable); a torn update is a :class:`TornUpdateError` whatever ended
    it."""
    if written and yielded:  # nothing of this receiver's is torn: what consumed the tensors holds them
        return torn(version, held, cause, written, total, "some tensors were yielded before the vote",
                    subject="whatever consumed them holds part of it", verb="yielded")  # fmt: skip
    if written:
        return torn(version, held, cause, written, total, "its tensors were written before the vote")
    kind = SyncRefusedError if isinstance(cause, SyncRefusedError) else WeightSyncError
    return kind(
        f"receiving version {version} failed: {type(cause).__name__}: {cause}; the target is untouched and "
        f"the version held is still {held}"
    )


class Ring:
    """The receiver's small ring of scratch buffers; its size is what the transport can use at once."""

    def __init__(self, buffers: _bytes.BufferCache, device: torch.device, name: str = "bucket") -> None:
        self.buffers, self.device, self.name = buffers, device, name
        self.size = 2

    def land(self, plan: Plan[Any], kind: Landing = Landing.SCRATCH) -> Land:
        def land(k: int) -> Landed:
            start, end = plan.bucket_range(k)
            return Landed(self.buffers.get(f"{self.name}{k % self.size}", end - start, self.device), kind)

        return land


class Applier:
    """The family's common part: every tensor's slot, the parts still to land per tensor (``parts``), and
    what each mode does once a tensor is whole (:meth:`whole`). ``plan``: the fan-out stream's cut, whose
    buckets may lie in the slots as they are; ``ring``: where its other buckets land. ``every=False``: a delta
    hands on only the tensors it changed."""

    def __init__(
        self, copier: Copier, names: Callable[[Any], str], parts: Counter[Any], *,
        plan: Plan | None = None, ring: Ring | None = None, every: bool = True,
        kept: _bytes.Kept | None = None,
    ) -> None:  # fmt: skip
        self.copier, self.names, self.left = copier, names, parts
        self.kept = kept if kept is not None else _bytes.Kept()
        """The views of each bucket's pieces where it lands, kept for the syncs that repeat a plan."""
        self.total = len(parts)
        self.plan, self.ring, self.every = plan, ring, every
        self.changed: set[Any] = set()
        """The tensors some landed bytes of which changed (a full sync: every one)."""
        self.written: list[str] = []
        """The target's tensors (partly) overwritten so far: a failure now leaves it torn."""
        self.casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(target, assembled apart) of the tensors this bucket made whole, copied in by the bucket's job."""
        self.flat: Sequence[torch.Tensor | None] = ()
        """The slots by manifest index where they hold the wire bytes as they are (for :meth:`direct`)."""

    def slot(self, key: Key) -> Slot:
        raise NotImplementedError

    def direct(self, k: int) -> torch.Tensor | None:
        """Bucket k of the fan-out plan where it belongs, when the slots lie in the plan's layout."""
        if self.plan is None:
            return None
        return _bytes.in_place_bucket(self.plan, k, self.flat, receiving=True)

    def land(self, k: int) -> Landed:
        """Where bucket k of the fan-out plan lands: where it belongs, else the ring."""
        view = self.direct(k)
        if view is not None:
            assert self.plan is not None
            self.writing([seg.key for seg in self.plan.buckets[k]])  # the transport writes there next
            return Landed(view, Landing.TARGET)
        assert self.ring is not None and self.plan is not None
        return self.ring.land(self.plan)(k)

    def held(self, k: int) -> torch.Tensor:
        """The version held of bucket k of the fan-out plan, for a delta to be applied to: where it lies, else
        packed from the slots into scratch (:meth:`write_back` puts it back)."""
        view = self.direct(k)
        if view is not None:
            return view
        assert self.plan is not None and self.ring is not None
        start, end = self.plan.bucket_range(k)
        view = self.ring.buffers.get("delta-held", end - start, self.ring.device)
        _bytes.pack(view, self.plan.buckets[k], self.flat)
        return view

    def write_back(self, k: int, view: torch.Tensor) -> None:
        assert self.plan is not None
        if self.direct(k) is None:
            _bytes.unpack(view, self.plan.buckets[k], self.flat)  # type: ignore[arg-type]

    def landed(
        self, parts: Sequence[Part], view: torch.Tensor | None, in_place: bool,
        changed: Collection[Any] | None = None,
    ) -> list[tuple[Any, torch.Tensor]]:  # fmt: skip
        """A bucket of ``parts`` landed in ``view`` (``in_place``: in their slots already, or unchanged by a
        delta); ``changed``: the tensors whose bytes it changed (None: all). Returns the (key, tensor) of the
        tensors it made whole that this mode hands on."""
        owned = isinstance(parts, tuple)  # a plan's own bucket, kept with the plan: so is what it is made of
        keys = self.kept.get(parts, "keys", None, partial(_keys, parts)) if owned else _keys(parts)
        moved = keys if changed is None else [key for key in keys if key in changed]
        self.changed.update(moved)
        out: list[_bytes.Part] = []
        if in_place:
            self.writing(moved)
        else:
            assert view is not None
            out = self.parts_of(parts)
            self.writing(keys)
        done = []
        if self.hands_on:
            left = self.left
            for key in keys:
                left[key] -= 1
                if not left[key]:
                    t = self.whole(key)
                    if t is not None:
                        done.append((key, t))
        if out or self.casts:  # one job on the copy thread per bucket: its parts, then what it completed
            casts, self.casts = self.casts, []
            at, rows = None, None
            if out:
                assert view is not None
                make = partial(_bytes.layout, view, out)
                # only a plan's own bucket is worth keeping a layout for: a list made for this bucket alone
                # (some of its parts) never comes again
                at = self.kept.get(parts, "unpack", _bytes.address(view), make) if owned else make()
                rows = self.rows(view, out) if owned else None
            self.copier.run(partial(_unpack_and_cast, at, out, casts, rows))
        return done

    @property
    def hands_on(self) -> bool:
        """Whether a tensor made whole is handed on (or cast in) as it is: else the parts are not counted."""
        return True

    def rows(self, view: torch.Tensor, out: list[_bytes.Part]) -> _bytes.Rows | None:
        """``out`` (a bucket's parts in their slots, this bucket landed in ``view``) unpacked as rows of one
        storage, where the slots are kept (see :class:`Staged`)."""
        return None

    def parts_of(self, parts: Sequence[Part]) -> list[_bytes.Part]:
        """A bucket's parts in their slots (a slot made on demand: made on this thread)."""
        return [p.part(self.slot(p.key)) for p in parts]

    def writing(self, keys: list[Any]) -> None:
        """These tensors' bytes are about to be (or were, in place) written: a copy that fails midway leaves
        them partly written."""

    def whole(self, key: Key) -> torch.Tensor | None:
        """Every part of ``key`` landed: what is handed on (None: nothing)."""
        return None

    def commit(self) -> None:
        """Every bucket arrived and was verified: make the new version the target's."""

    def failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        """The error for a failure before the commit: untouched, or torn where something was written."""
        return refused(version, held, cause, self.written, self.total)

    def commit_failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        """The error for a failure in :meth:`commit`."""
        return self.failed(cause, version, held)


class Scratch(Applier):
    """``receive()`` without a kept buffer: each tensor made on ``device`` as its first part lands
    (``spec(key)``: its dtype, shape and the box it is of) and let go once handed on: the receiver holds the
    tensors in flight, not a model made up front, and what it hands on is the consumer's alone. With
    ``views`` (a fan-out stream, landing in this receiver's own ring, never in a transport's shared slot:
    that is a mapping of the sender's memory, read-only over ``shm``), a tensor one bucket holds whole is
    handed on as a view of that bucket (no copy), valid until the next bucket."""

    def __init__(
        self, copier: Copier, names: Callable[[Any], str], parts: Counter[Any],
        spec: Callable[[Any], tuple[torch.dtype, tuple[int, ...], Any]], device: torch.device, *,
        views: bool = False, plan: Plan | None = None, ring: Ring | None = None, every: bool = True,
        kept: _bytes.Kept | None = None,
    ) -> None:  # fmt: skip
        super().__init__(copier, names, parts, plan=plan, ring=ring, every=every, kept=kept)
        self.spec, self.device = spec, device
        self.slots: dict[Any, Slot] = {}
        self.alone = {key for key, n in parts.items() if n == 1} if views else set()
        """The tensors one bucket holds whole."""

    def land(self, k: int) -> Landed:
        assert self.ring is not None and self.plan is not None
        return self.ring.land(self.plan, Landing.STAGING)(k)

    def slot(self, key: Key) -> Slot:
        slot = self.slots.get(key)
        if slot is None:
            dtype, shape, box = self.spec(key)
            slot = self.slots[key] = (torch.empty(shape, dtype=dtype, device=self.device), box)
        return slot

    def landed(
        self, parts: Sequence[Part], view: torch.Tensor | None, in_place: bool,
        changed: Collection[Any] | None = None,
    ) -> list[tuple[Any, torch.Tensor]]:  # fmt: skip
        alone = [p for p in parts if p.key in self.alone]
        if not alone or view is None:
            return super().landed(parts, view, in_place, changed)
        done = super().landed([p for p in parts if p.key not in self.alone], view, in_place, changed)
        for p in alone:  # viewed where it landed, in its bucket
            dtype, shape, _ = self.spec(p.key)
            self.changed.add(p.key)
            done.append((p.key, _bytes.typed_view(view, p.bucket_offset, dtype, shape)))
        return done

    def whole(self, key: Key) -> torch.Tensor | None:
        tensor = self.slots.pop(key)[0]  # no part of it is left to land: let go here
        return tensor if self.every or key in self.changed else None


class Staged(Applier):
    """Every tensor in one kept buffer (``slots``: a view of it per tensor; a fan-out plan's buckets land in
    it as they are). Without ``dest`` (``receive()``) the views are handed on as tensors become whole (all,
    or only what a delta changed); with ``dest`` (atomic ``receive_into``: (the key it is staged under, a
    target tensor, its name)) they are copied into the target at the commit, only what changed when
    ``only_changed`` (a delta applied to the version that target held)."""

    def __init__(
        self, copier: Copier, names: Callable[[Any], str], parts: Counter[Any], slots: Mapping[Any, Slot],
        *, buffer: torch.Tensor | None = None, dest: list[tuple[Any, torch.Tensor, str]] | None = None,
        only_changed: bool = False, plan: Plan | None = None, ring: Ring | None = None, every: bool = True,
        kept: _bytes.Kept | None = None,
    ) -> None:  # fmt: skip
        super().__init__(copier, names, parts, plan=plan, ring=ring, every=every, kept=kept)
        self.slots, self.buffer, self.dest, self.only_changed = slots, buffer, dest, only_changed

    def slot(self, key: Key) -> Slot:
        return self.slots[key]

    def parts_of(self, parts: Sequence[Part]) -> list[_bytes.Part]:
        """In the kept buffer, the same views every sync of a plan: made once (see ``_bytes.Kept``)."""
        if self.buffer is None:
            return super().parts_of(parts)
        return self.kept.get(
            parts,
            "staged",
            (_bytes.address(self.buffer), _bytes.Same(self.slots)),
            partial(super().parts_of, parts),
        )

    def rows(self, view: torch.Tensor, out: list[_bytes.Part]) -> _bytes.Rows | None:
        """Kept with ``out``: one list while the plan, buffer and slots are the same (:meth:`parts_of`)."""
        if self.buffer is None:
            return None
        return self.kept.get(out, "rows", _bytes.address(view), partial(_bytes.rows, view, out))

    @property
    def hands_on(self) -> bool:
        return self.dest is None  # into a target: copied at the commit, every tensor at once

    def direct(self, k: int) -> torch.Tensor | None:
        if self.plan is None or self.buffer is None:
            return None
        return self.buffer[slice(*self.plan.bucket_range(k))]  # laid out as the plan is, by construction

    def whole(self, key: Key) -> torch.Tensor | None:
        if self.dest is not None or not (self.every or key in self.changed):
            return None
        return self.slots[key][0]

    def commit(self) -> None:
        if self.dest is None:
            return
        pairs = [
            (target, self.slots[key][0])
            for key, target, _ in self.dest
            if target.numel() and not (self.only_changed and key not in self.changed)
        ]

        def apply() -> None:
            moved = [(t, s) for t, s in pairs if t.data_ptr() != s.data_ptr()]
            if moved:
                with torch.no_grad():
                    torch._foreach_copy_([t for t, _ in moved], [s for _, s in moved])

        self.copier.run(apply)

    def commit_failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        """Every byte arrived, but copying it into the target failed midway: the target is torn."""
        written = [name for _, _, name in self.dest or ()]
        return torn(
            version, held, cause, written, len(written), "every byte arrived, but copying into the target"
        )


class Streaming(Applier):
    """The target's own tensors (``targets``: key -> slot), written as buckets land: in place where a fan-out
    plan's bucket lies in them, else unpacked at once; a tensor that cannot take the wire bytes as they are
    (``wire``: key -> its wire dtype, where it differs, or where the target is not contiguous) is assembled
    apart and copied in once whole. ``tied(only)``: the commit's last step, writing tied names (the fan-out's
    aliases) and returning them."""

    def __init__(
        self, copier: Copier, names: Callable[[Any], str], parts: Counter[Any], targets: Mapping[Any, Slot],
        *, wire: Mapping[Any, torch.dtype] | None = None, flat: Sequence[torch.Tensor | None] = (),
        tied: Callable[[set[Any] | None], list[str]] | None = None, delta: bool = False,
        plan: Plan | None = None, ring: Ring | None = None, kept: _bytes.Kept | None = None,
    ) -> None:  # fmt: skip
        super().__init__(copier, names, parts, plan=plan, ring=ring, kept=kept)
        self.targets, self.wire, self.flat = targets, wire or {}, flat
        self.tied, self.delta = tied, delta
        self.apart: dict[Any, torch.Tensor] = {}
        self._seen: set[Any] = set()

    def slot(self, key: Key) -> Slot:
        if key not in self.wire:
            return self.targets[key]
        t = self.apart.get(key)
        if t is None:
            t = self.apart[key] = torch.empty(self.targets[key][0].shape, dtype=self.wire[key],
                                              device=self.targets[key][0].device)  # fmt: skip
        return t, self.targets[key][1]

    def writing(self, keys: list[Any]) -> None:
        new = [k for k in keys if k not in self._seen]
        self._seen.update(new)
        self.written.extend(self.names(k) for k in new)

    def whole(self, key: Key) -> torch.Tensor | None:
        apart = self.apart.pop(key, None)
        if apart is not None:
            self.casts.append((self.targets[key][0], apart))
        return None

    def commit(self) -> None:
        if self.tied is not None:
            with torch.no_grad():
                self.written.extend(self.tied(self.changed if self.delta else None))

    def failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        """Torn, whatever ``written`` lists: bytes may reach the target before they are counted (a transport
        receiving in place, a delta applied there), so a streaming receive that failed never says the target
        is untouched."""
        how = "a delta changed some tensors" if self.delta else "some buckets were written"
        return torn(version, held, cause, self.written, self.total, how)


def _keys(parts: Sequence[Part]) -> list[Any]:
    return [p.key for p in parts]


def _unpack_and_cast(
    at: _bytes.Layout | None,
    parts: list[_bytes.Part],
    casts: list[tuple[torch.Tensor, torch.Tensor]],
    rows: _bytes.Rows | None,
) -> None:
    if parts:
        assert at is not None
        _bytes.copy_out(parts, at, rows)
    with torch.no_grad():
        for target, apart in casts:
            target.copy_(apart)


def fill_aliases(manifest: Manifest, dest: list[torch.Tensor], only: set[int] | None = None) -> list[int]:
    """Copy each tied name's tensor into its own storage where the target keeps it apart (the sources in
    ``only``, when given); returns the tied entries written."""
    done = []
    for i, e in enumerate(manifest.entries):
        j = manifest.sources[i]
        if e.alias_of is None or (only is not None and j not in only):
            continue
        if dest[i].data_ptr() != dest[j].data_ptr() and dest[j].numel():
            dest[i].copy_(dest[j])
        done.append(i)
    return done


def wire_typed(d: torch.Tensor, e: Entry) -> bool:
    """The tensor can hold the wire bytes as they are (contiguous, in the wire dtype)."""
    return d.is_contiguous() and d.dtype == dtype_from_name(e.wire_dtype)


def hand_on(ready: list[tuple[Any, torch.Tensor]]) -> Iterator[tuple[Any, torch.Tensor]]:
    """What became whole, in order, each let go of here as it is handed on: a tensor of its own that the
    consumer drops is freed then, not when the rest of its bucket's tensors are taken."""
    ready.reverse()  # nothing is added while it is handed on (the stream waits on the consumer)
    while ready:
        yield ready.pop()


def counts(buckets: Iterable[Sequence[Part]]) -> Counter[Any]:
    """How many parts of each tensor these buckets bring."""
    return Counter(p.key for parts in buckets for p in parts)
