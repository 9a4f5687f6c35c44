"""Where a sync's bytes go on a receiver, and what "done" means: one applier per receive mode, chosen once.

- :class:`Scratch` (``receive()``): buckets land in a small ring of scratch buffers of its own and
  tensors are yielded as views of them.
- :class:`Staged` (atomic ``receive_into``, and ``receive()`` when the source keeps a base): buckets land in
  one model-size buffer; a delta is applied to it (it holds the version last received); on commit an atomic
  receive copies it into the target (only the tensors that changed, for a delta), while ``receive()`` yields
  views of it as buckets complete.
- :class:`Streaming` (``receive_into(atomic=False)``): buckets land in the target's own storage where it is
  laid out as the plan is, else in scratch and are unpacked at once; a delta is applied to the target
  tensors themselves.

Every applier answers the same calls: ``land(k)`` (where bucket k of a full sync lands), ``held(k)`` and
``write_back(k, view)`` (the version held, for a delta to be applied to), ``landed(bucket)`` (bucket k is
complete: returns the (entry, tensor) pairs it completes, for ``receive()``), ``commit()`` and
``failed(cause)`` (the error a failure midway raises: untouched or torn).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from ..codec import dtype_from_name
from ..errors import SyncRefusedError, TornUpdateError, WeightSyncError
from . import _bytes
from ._copier import Copier
from ._delta_sync import TargetStore
from .manifest import Entry, Manifest
from .plan import Plan
from .transports import Land, Landed, Landing

__all__ = ["Applier", "Ring", "Scratch", "Staged", "Streaming", "copy_staged", "refused", "torn"]

Bucket = tuple[int, torch.Tensor, bool, list[int]]
"""(k, view of its new bytes, whether they are in the target already, the entries it changed)."""

Pair = tuple[int, torch.Tensor]
"""(manifest entry index, tensor)."""

Names = Callable[[int], str]
"""A manifest entry's name on this receiver."""


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

    def __init__(self, buffers: _bytes.BufferCache, device: torch.device) -> None:
        self.buffers = buffers
        self.device = device
        self.size = 2

    def land(self, plan: Plan) -> Land:
        def land(k: int) -> Landed:
            start, end = plan.bucket_range(k)
            view = self.buffers.get(f"bucket{k % self.size}", end - start, self.device)
            return Landed(view, Landing.SCRATCH)

        return land


class Applier:
    """The common part: a plan, a manifest, a ring, a copy thread. Subclasses say where bytes go."""

    def __init__(self, plan: Plan, manifest: Manifest, ring: Ring, copier: Copier, names: Names) -> None:
        self.plan = plan
        self.manifest = manifest
        self.entries = manifest.entries
        self.ring = ring
        self.device = ring.device
        self.copier = copier
        self.names = names
        self.written: list[str] = []
        """The target's tensors this applier has (partly) overwritten so far: a failure then is torn."""

    def land(self, k: int) -> Landed:
        return self.ring.land(self.plan)(k)

    def held(self, k: int) -> torch.Tensor:
        raise AssertionError(f"{type(self).__name__} holds no version to apply a delta to")

    def write_back(self, k: int, view: torch.Tensor) -> None:
        """Nothing to do where ``held`` returned the held bytes themselves."""

    def landed(self, k: int, view: torch.Tensor, in_place: bool, changed: list[int]) -> Iterable[Pair]:
        return ()

    def commit(self) -> None:
        """Every bucket arrived and was verified: make the new version the target's."""

    def commit_failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        """The error for a failure in :meth:`commit`."""
        return self.failed(cause, version, held)

    def failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        """The error for a failure before the commit."""
        return WeightSyncError(
            f"receiving version {version} failed: {type(cause).__name__}: {cause}; the target is untouched "
            f"and the version held is still {held}"
        )

    def typed(self, buffer: torch.Tensor, offset: int, i: int) -> torch.Tensor:
        e = self.entries[i]
        return _bytes.typed_view(buffer, offset, dtype_from_name(e.wire_dtype), e.shape)


class Scratch(Applier):
    """``receive()`` of a source that keeps no base: tensors are views of the scratch bucket they arrived
    in, valid until the next bucket; a tensor spanning buckets is assembled into its own memory. The
    buckets land in this receiver's own ring, never in a transport's shared slot: a slot is a mapping of
    the sender's memory (read-only over ``shm``, where a consumer's write would kill the process; the
    sender's, over CUDA IPC), and the tensors are the consumer's to use."""

    def __init__(self, plan: Plan, manifest: Manifest, ring: Ring, copier: Copier, names: Names) -> None:
        super().__init__(plan, manifest, ring, copier, names)
        self._assembling: dict[int, torch.Tensor] = {}

    def land(self, k: int) -> Landed:
        return Landed(self.ring.land(self.plan)(k).view, Landing.STAGING)

    def landed(self, k: int, view: torch.Tensor, in_place: bool, changed: list[int]) -> Iterable[Pair]:
        ready: list[Pair] = []
        for seg in self.plan.buckets[k]:
            e = self.entries[seg.index]
            if seg.nbytes == e.nbytes:
                ready.append((seg.index, self.typed(view, seg.bucket_offset, seg.index)))
                continue
            full = self._assembling.get(seg.index)
            if full is None:
                dtype = dtype_from_name(e.wire_dtype)
                full = self._assembling[seg.index] = torch.empty(e.shape, dtype=dtype, device=self.device)
            self.copier.copy(
                _bytes.byte_view(full)[seg.tensor_offset : seg.tensor_offset + seg.nbytes],
                view[seg.bucket_offset : seg.bucket_offset + seg.nbytes],
            )
            if seg.tensor_offset + seg.nbytes == e.nbytes:
                ready.append((seg.index, self._assembling.pop(seg.index)))
        return ready


class Staged(Applier):
    """One plan-layout buffer that every bucket lands in (or, for a delta, is applied to: it holds the
    version last received). With ``dest`` (atomic ``receive_into``) the commit copies it into the target;
    without (``receive()``), tensors are yielded as views of it as their last bytes land (``every``: all of
    them, else only those a delta changed)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        plan: Plan,
        manifest: Manifest,
        ring: Ring,
        copier: Copier,
        names: Names,
        *,
        dest: list[torch.Tensor] | None = None,
        delta: bool = False,
        every: bool = True,
    ) -> None:
        super().__init__(plan, manifest, ring, copier, names)
        self.buffer = buffer
        self.dest = dest
        self.delta = delta
        self.every = every
        self.changed: set[int] = set()

    def land(self, k: int) -> Landed:
        return Landed(self.held(k), Landing.STAGING)

    def held(self, k: int) -> torch.Tensor:
        start, end = self.plan.bucket_range(k)
        return self.buffer[start:end]

    def landed(self, k: int, view: torch.Tensor, in_place: bool, changed: list[int]) -> Iterable[Pair]:
        self.changed.update(changed)
        if self.dest is not None:
            return ()
        return [
            (seg.index, self.typed(self.buffer, self.plan.offsets[seg.index], seg.index))
            for seg in self.plan.buckets[k]
            if seg.tensor_offset + seg.nbytes == self.entries[seg.index].nbytes  # its last bytes
            and (self.every or seg.index in self.changed)
        ]

    def commit(self) -> None:
        dest = self.dest
        if dest is not None:
            copy_staged(self.copier, (
                (dest[i], self.typed(self.buffer, self.plan.offsets[j], j))
                for i, j in enumerate(self.manifest.sources)
                if self.entries[j].numel and not (self.delta and j not in self.changed)
            ))  # fmt: skip

    def commit_failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        """Every byte arrived, but copying it into the target failed midway: the target is torn."""
        written = [self.names(i) for i in range(len(self.entries))]
        return torn(
            version, held, cause, written, len(written), "every byte arrived, but copying into the target"
        )


class Streaming(Applier):
    """The target's own tensors, bucket by bucket: in place where the target is laid out as the plan is,
    else through scratch; a delta is applied to the target tensors themselves (contiguous, in the wire
    dtype). ``written`` names what was (partly) overwritten, for a torn update's error."""

    def __init__(
        self,
        plan: Plan,
        manifest: Manifest,
        ring: Ring,
        copier: Copier,
        names: Names,
        dest: list[torch.Tensor],
        buffers: _bytes.BufferCache,
        *,
        delta: bool,
    ) -> None:
        super().__init__(plan, manifest, ring, copier, names)
        self.dest = dest
        self.delta = delta
        self._seen: set[int] = set()
        self._wire_ok = [wire_typed(d, e) for d, e in zip(dest, self.entries, strict=True)]
        ok = self._wire_ok
        self._direct: list[torch.Tensor | None] = [d if w else None for d, w in zip(dest, ok, strict=True)]
        self._partial: dict[int, torch.Tensor] = {}
        self._store = TargetStore(dest, plan, buffers)

    def land(self, k: int) -> Landed:
        view = _bytes.in_place_bucket(self.plan, k, self._direct, receiving=True)
        return Landed(view, Landing.TARGET) if view is not None else super().land(k)

    def held(self, k: int) -> torch.Tensor:
        return self._store.view(k)

    def write_back(self, k: int, view: torch.Tensor) -> None:
        self._store.write_back(k, view)

    def landed(self, k: int, view: torch.Tensor, in_place: bool, changed: list[int]) -> Iterable[Pair]:
        if self.delta:
            self.written.extend(self.names(i) for i in changed if i not in self._seen)
            self._seen.update(changed)
        elif in_place:
            self.written.extend(
                self.names(seg.index) for seg in self.plan.buckets[k] if seg.tensor_offset == 0
            )
        else:
            self.copier.run(lambda: self._unpack(k, view))
        return ()

    def _unpack(self, k: int, view: torch.Tensor) -> None:
        with torch.no_grad():
            parts: list[_bytes.Part] = []
            for seg in self.plan.buckets[k]:
                i, a, b = seg.index, seg.tensor_offset, seg.tensor_offset + seg.nbytes
                e, d = self.entries[i], self.dest[i]
                if not self._wire_ok[i] and i not in self._partial:  # assembled in the wire dtype, then cast
                    wire = dtype_from_name(e.wire_dtype)
                    self._partial[i] = torch.empty(e.shape, dtype=wire, device=d.device)
                out = _bytes.byte_view(d if self._wire_ok[i] else self._partial[i])
                parts.append((seg.bucket_offset, seg.nbytes, out[a:b], torch.uint8))
            _bytes.unpack_parts(view, parts)
            for seg in self.plan.buckets[k]:
                i = seg.index
                if seg.tensor_offset == 0:
                    self.written.append(self.names(i))
                if i in self._partial and seg.tensor_offset + seg.nbytes == self.entries[i].nbytes:
                    self.dest[i].copy_(self._partial.pop(i))

    def commit(self) -> None:
        with torch.no_grad():
            tied = fill_aliases(self.manifest, self.dest, self._seen if self.delta else None)
        self.written.extend(self.names(i) for i in tied)

    def failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        how = "a delta changed some tensors" if self.delta else "some buckets were written"
        return torn(version, held, cause, self.written, len(self.entries), how)

    commit_failed = failed


def copy_staged(copier: Copier, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """An atomic receive's commit: each (target, staged) pair copied on the copy thread (``pairs`` is read
    there), a target that is the staged tensor itself left as it is."""

    def apply() -> None:
        with torch.no_grad():
            for target, staged in pairs:
                if target.data_ptr() != staged.data_ptr():
                    target.copy_(staged)

    copier.run(apply)


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


def run_through(buckets: Iterator[Bucket], applier: Applier) -> Iterator[Pair]:
    """Feed every bucket to the applier; yields the pairs it completes."""
    for k, view, in_place, changed in buckets:
        yield from applier.landed(k, view, in_place, changed)
