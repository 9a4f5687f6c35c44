"""WeightReceiver: take weights from the sending rank, streamed or all-or-nothing, verified on request."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from functools import partial
from typing import Any, NamedTuple, NoReturn

import torch

from ..codec import dtype_from_name
from ..control import Deadline
from ..errors import GroupBridgeError, TornUpdateError, WeightSyncError
from ..stateless import StatelessGroup
from . import _bytes, _delta
from ._copier import Copier
from ._delta_sync import (
    BufferStore,
    Description,
    TargetStore,
    delta_digest,
    delta_groups,
    wire_plan,
    word_counts,
)
from ._protocol import ACK_TAG, Header, Settled, laid_out_in_place, make_renamer, merged_plan, settle
from .manifest import Manifest, compare, expected_specs, mismatch_message, tensors_of
from .plan import Plan, PlanCache
from .transports import Land, Landed, Landing, RxTransport, Sync, spec


class _VerifyFailed(WeightSyncError):
    """The bytes arrived but do not match the sender's digests (the group itself is fine)."""


logger = logging.getLogger(__name__)

__all__ = ["WeightReceiver", "WeightUpdate"]


class WeightUpdate:
    """One incoming version; iterate it for (name, tensor) pairs as buckets arrive.

    A yielded tensor is a view into a receive buffer (with ``shm``, into the sender's shared slot) and stays
    valid only until the tensors of the next bucket are yielded: consume or copy it before asking for more
    (``load_weights`` copies each tensor at once). A tensor that spans buckets is yielded as its own copy.
    Tied names are yielded right after the tensor they share. The receiver's ``version`` becomes this
    update's version only once iteration has finished and the digests (when on) matched: a consumer that
    applies tensors as they come must treat a failure as a torn update. Stopping early (``break``, an
    exception in the consumer, dropping the iterator) aborts the sync for everyone, since the sender cannot
    finish it; the ``timeout`` given to :meth:`WeightReceiver.receive` bounds the whole update.

    When the sender sends deltas (``WeightSender(delta=True)``) the receiver keeps the version it holds (one
    copy of the model's wire bytes) and yields views of that copy instead, valid until the next sync and
    not to be written to; a delta update (``delta`` True) yields only the tensors that changed, each whole,
    so an engine's ``load_weights`` touches only them.
    """

    def __init__(
        self, receiver: WeightReceiver, settled: Settled, deadline: Deadline, only_changed: bool = True
    ) -> None:
        self.version = settled.header.version
        self.manifest = settled.manifest
        self.delta = settled.delta
        """This update travels as a delta against the version held."""
        self.kept = settled.header.delta
        """The yielded tensors are views of the receiver's kept copy: valid until the next sync."""
        self._only_changed = only_changed
        self._receiver = receiver
        self._settled = settled
        self._deadline = deadline
        self._started = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a WeightUpdate can be iterated once")
        self._started = True
        rcv, (header, manifest, _, delta) = self._receiver, self._settled
        every = not (delta and self._only_changed)
        if header.delta:
            pairs = rcv._kept_pairs(header, manifest, delta, every, self._deadline)
        else:
            pairs = rcv._scratch_pairs(header, manifest, self._deadline)
        return rcv._yield_update(header, manifest, pairs, every)


class WeightReceiver:
    """Receives weights sent by rank ``src`` of ``group``.

    Args:
        group: the bridge.
        src: the sending rank.
        expected: the receiver's own module, state dict, or mapping name -> (shape, dtype); the sender's
            manifest is checked against it before any bytes move. ``receive_into`` checks against its target
            when this is not given.
        rename: a callable or mapping from names on the wire to this receiver's names.
        device: where received buckets land for ``receive()`` (default: CPU).
        intra_op_threads: accepted for compatibility and ignored: bulk copies run on a thread the library
            owns (see :mod:`groupbridge.weights._copier`); the caller's thread settings are never changed.
    """

    def __init__(
        self,
        group: StatelessGroup,
        *,
        src: int = 0,
        expected: Any = None,
        rename: Callable[[str], str] | Mapping[str, str] | None = None,
        device: str | torch.device = "cpu",
        intra_op_threads: int | None = 1,
    ) -> None:
        if src == group.rank:
            raise ValueError(f"src={src} is this rank; the receiver must be another rank")
        self.group = group
        self.src = src
        self.expected = expected_specs(expected) if expected is not None else None
        self.version: int | None = None
        """The version last applied in full (None before the first)."""
        self.device = torch.device(device)
        del intra_op_threads
        self._copier = Copier(f"{group.name}-{group.rank}")
        self._rename = make_renamer(rename)
        self._known: dict[str, Manifest] = {}
        self._buffers = _bytes.BufferCache()
        self._transports: dict[str, RxTransport] = {}
        self._plans = PlanCache()
        self._scratch_buffers = 2
        """The ring of scratch buffers the current transport needs (set when it is set up)."""
        self._held: tuple[Any, ...] | None = None
        """For delta syncs: (how the base is kept, version, manifest digest) of the version held in full."""

    # ------------------------------------------------------------------ handshake

    def _settle(
        self,
        expected: dict[str, tuple[tuple[int, ...], str]] | None,
        allow_stale: bool,
        targets: dict[str, torch.Tensor] | None,
        deadline: Deadline,
        accept: Callable[[Manifest], str | None] | None = None,
        keep: tuple[Any, ...] = (),
    ) -> Settled:
        def check(header: Header, manifest: Manifest) -> dict[str, Any] | None:
            if not allow_stale and self.version is not None and header.version <= self.version:
                return {
                    "kind": "stale",
                    "message": f"holds version {self.version}; version {header.version} is not newer",
                }
            if expected is not None:
                renamed = Manifest(tuple(_renamed(e, self._rename) for e in manifest.entries))
                problems = compare(renamed, expected)
                if any(problems.values()):
                    return {
                        "kind": "manifest",
                        "message": mismatch_message(problems, f"rank {self.group.rank}"),
                    }
            if accept is not None:
                renamed = Manifest(tuple(_renamed(e, self._rename) for e in manifest.entries))
                problem = accept(renamed)
                if problem is not None:
                    return {"kind": "manifest", "message": problem}
            return None

        def in_place(header: Header, manifest: Manifest) -> bool:
            if targets is None:
                return False
            dest: list[torch.Tensor | None] = []
            for e in manifest.entries:
                d = targets.get(self._rename(e.name))
                dest.append(d if d is not None and d.dtype == dtype_from_name(e.wire_dtype) else None)
            return laid_out_in_place(manifest, dest, receiving=True)

        def has_base(header: Header, manifest: Manifest) -> bool:
            return bool(keep) and self._held == (keep, header.base, manifest.digest) == (
                keep, self.version, manifest.digest
            )  # fmt: skip

        return settle(self.group, self.src, None, None, self._known, check, in_place, deadline, has_base)

    def _delta_buckets(
        self,
        header: Header,
        manifest: Manifest,
        plan: Plan,
        store: Any,
        device: torch.device,
        deadline: Deadline,
    ) -> Iterator[tuple[int, list[int]]]:
        """Receive a delta (see :mod:`._delta_sync`) and apply it to ``store``; yields every changed bucket
        and the entries in it that changed. Each payload's digest is checked before it is applied, and every
        bucket after; a mismatch drains the rest (the sender is still sending) and raises _VerifyFailed."""
        kind = delta_digest(header)
        sizes, words = word_counts(plan, manifest)
        failed: str | None = None
        for a, b in delta_groups(plan):
            wire = self.group.broadcast_obj(None, src=self.src, timeout=deadline)
            desc = Description.from_wire(wire, words[a:b])
            wplan, sources = wire_plan(desc, sizes[a:b], words[a:b])
            if not sources:
                continue
            rx = self._transport(header, wplan, device, deadline)
            for j, view, _ in rx.buckets(wplan, self._ring(wplan, device), deadline):
                if failed is not None:
                    continue  # the sender is still sending: take the rest, apply nothing
                i = sources[j]
                k = a + i
                if _bytes.digest(view, kind, self.group) != desc.wire_digests[j]:
                    failed = f"the delta of bucket {k} arrived corrupted (its {kind} does not match)"
                    continue
                old = store.view(k)
                code, count, w = desc.codes[i], desc.counts[i], sizes[k]
                pos = self._copier.run(partial(_delta.apply, old, view, code, count, w))
                if _bytes.digest(old, kind, self.group) != desc.digests[i]:
                    failed = (
                        f"bucket {k} does not match the sender's version {header.version} after applying the "
                        f"delta: this receiver's copy of version {header.base} differs from the sender's"
                    )
                    continue
                store.write_back(k, old)
                yield k, _delta.changed_entries(plan, k, pos, w)
        if failed is not None:
            raise _VerifyFailed(failed)

    # ------------------------------------------------------------------ buckets

    def _plan(self, manifest: Manifest, header: Header) -> Plan:
        return self._plans.get(manifest, header.bucket_bytes, header.solo_bytes)

    def _transport(self, header: Header, plan: Plan, device: torch.device, deadline: Deadline) -> RxTransport:
        """The transport the header names, set up with the options the sender announced."""
        chosen = spec(header.transport)
        options = chosen.parse(header.transport_options, self.group.world_size, self.src)
        rx = self._transports.get(header.transport)
        if rx is None:
            rx = self._transports[header.transport] = chosen.make_rx(self.group, self.src)
        rx.setup(plan, device, Sync(header.sync_id, deadline, options, self._copier.copy))
        self._scratch_buffers = rx.scratch_buffers
        return rx

    def _buckets(
        self,
        header: Header,
        plan: Plan,
        rx: RxTransport,
        land: Land,
        deadline: Deadline,
    ) -> Iterator[tuple[int, torch.Tensor, bool]]:
        """Every bucket as it arrives, through the transport the sender announced; digests checked last."""
        mine: list[int | bytes] = []
        n = len(plan.buckets)
        for k, view, in_place in rx.buckets(plan, land, deadline):
            if header.verify:
                mine.append(_bytes.digest(view, header.verify, self.group))
            yield k, view, in_place
        if header.verify:
            sent = self.group.broadcast_obj(None, src=self.src, timeout=deadline)
            if not isinstance(sent, list) or len(sent) != n:
                raise _VerifyFailed(f"the sender's digests are malformed ({type(sent).__name__})")
            bad = [k for k, (a, b) in enumerate(zip(sent, mine, strict=True)) if a != b]
            if bad:
                raise _VerifyFailed(
                    f"{header.verify} mismatch in bucket(s) {', '.join(map(str, bad[:20]))} of {n}: the "
                    "bytes that arrived are corrupted, short or were not sent by the group's sender"
                )

    def _ring(self, plan: Plan, device: torch.device) -> Land:
        def land(k: int) -> Landed:
            start, end = plan.bucket_range(k)
            view = self._buffers.get(f"bucket{k % self._scratch_buffers}", end - start, device)
            return Landed(view, Landing.SCRATCH)

        return land

    def _ack(self, ok: bool, error: str | None = None) -> None:
        self.group.send_obj({"ok": ok, "error": error}, dst=self.src, tag=ACK_TAG)

    def _commit(self, version: int) -> None:
        """Tell the sender this receiver holds ``version``; a receive whose acknowledgement cannot be sent
        fails (the sender could not know it succeeded and fails the sync)."""
        try:
            self._ack(True)
        except GroupBridgeError as e:
            raise WeightSyncError(
                f"rank {self.group.rank} holds version {version}, but could not acknowledge it to the sender "
                f"(rank {self.src}): {e}; the sender fails this sync"
            ) from e

    def _fail(self, e: BaseException, what: str) -> None:
        """Tell the sender how this side failed: a digest mismatch by a negative acknowledgement (the group
        stays usable), anything else by aborting the group (the sender cannot finish the sync)."""
        if isinstance(e, _VerifyFailed):
            try:
                self._ack(False, str(e))
            except GroupBridgeError:  # the sender then times out on this rank; the caller gets ``e`` anyway
                logger.warning("rank %d could not tell the sender it refused the bytes", self.group.rank)
        else:
            self.group.abort(f"rank {self.group.rank} gave up {what}: {type(e).__name__}: {e}")

    def _gave_up(self, cause: BaseException, what: str, error: Exception) -> NoReturn:
        """Tell the peers how ``what`` failed (see :meth:`_fail`), then raise ``error`` from ``cause``; an
        interrupt (a BaseException that is not an Exception) propagates unchanged."""
        self._fail(cause, what)
        try:
            if not isinstance(cause, Exception):
                raise cause
            raise error from cause
        finally:  # this frame must not hold what it raised: a cycle would keep the sync's buffers (shared
            del cause, error  # slots among them) mapped until the cycle collector runs

    def close(self) -> None:
        """Release transport mappings, buffers and the copy thread. The group stays open."""
        for rx in self._transports.values():
            rx.close()
        self._transports.clear()
        self._buffers.clear()
        self._copier.close()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ receive()

    def receive(
        self,
        *,
        allow_stale: bool = False,
        timeout: timedelta | None = None,
        accept: Callable[[Manifest], str | None] | None = None,
        only_changed: bool = True,
    ) -> WeightUpdate:
        """Start receiving the next version; the returned update yields (name, tensor) as buckets arrive.

        ``timeout`` (default: the group's) bounds the whole update, the handshake here and the iteration.
        ``accept`` sees the (renamed) manifest before any bytes move and returns None to take it, or a
        message saying why this receiver cannot: every member then raises ManifestMismatchError with that
        message and the group stays usable (an inference engine uses this to dry-run its own loader).
        ``only_changed=False``: a delta update yields every tensor too (of the kept copy, once the delta is
        applied), for an engine whose loader needs whole layers; only the changes travel either way.

        Raises:
            ManifestMismatchError: the manifest differs from ``expected``; nothing moved.
            WeightSyncError: the version is not newer than the one held (unless ``allow_stale``), or the
                sender refused the sync.
        """
        deadline = self.group.deadline(timeout)
        settled = self._settle(self.expected, allow_stale, None, deadline, accept, keep=("receive",))
        return WeightUpdate(self, settled, deadline, only_changed)

    def _yield_update(
        self, header: Header, manifest: Manifest, pairs: Iterator[tuple[int, torch.Tensor]], every: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Name the (entry, tensor) pairs that ``pairs`` produces (tied names right after their tensor; empty
        tensors last, on a full sync); on success take the version, on any failure tell the peers."""
        entries = manifest.entries
        aliases: dict[int, list[str]] = {}
        for i, e in enumerate(entries):
            if e.alias_of is not None:
                aliases.setdefault(manifest.sources[i], []).append(self._rename(e.name))
        yielded: list[str] = []
        self._held = None
        try:
            for index, t in pairs:
                for name in (self._rename(entries[index].name), *aliases.get(index, [])):
                    yielded.append(name)
                    yield name, t
            for i, e in enumerate(entries):  # empty tensors have no bytes in any bucket
                if e.alias_of is None and e.nbytes == 0 and every:
                    t = torch.empty(e.shape, dtype=dtype_from_name(e.wire_dtype), device=self.device)
                    for name in (self._rename(e.name), *aliases.get(i, [])):
                        yielded.append(name)
                        yield name, t
        except GeneratorExit:
            self._fail(
                RuntimeError(f"the consumer stopped after {len(yielded)} of {len(entries)} tensors"),
                f"receiving version {header.version}",
            )
            raise
        except BaseException as e:
            self._gave_up(e, f"receiving version {header.version}", TornUpdateError(
                f"receiving version {header.version} failed after {len(yielded)} tensors were yielded: "
                f"{type(e).__name__}: {e}; whatever consumed them is torn; version held is still "
                f"{self.version}",
                written=yielded,
            ))  # fmt: skip
        self.version = header.version
        if header.delta:
            self._held = (("receive",), header.version, manifest.digest)
        self._commit(header.version)

    def _scratch_pairs(
        self, header: Header, manifest: Manifest, deadline: Deadline
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Every tensor as its buckets arrive in the scratch ring (a tensor spanning buckets: as a copy)."""
        plan = self._plan(manifest, header)
        entries = manifest.entries
        assembling: dict[int, torch.Tensor] = {}
        rx = self._transport(header, plan, self.device, deadline)
        for k, view, _ in self._buckets(header, plan, rx, self._ring(plan, self.device), deadline):
            ready: list[tuple[int, torch.Tensor]] = []
            for seg in plan.buckets[k]:
                e = entries[seg.index]
                dtype = dtype_from_name(e.wire_dtype)
                if seg.nbytes == e.nbytes:
                    ready.append((seg.index, _bytes.typed_view(view, seg.bucket_offset, dtype, e.shape)))
                    continue
                full = assembling.setdefault(seg.index, torch.empty(e.shape, dtype=dtype, device=self.device))
                self._copier.copy(
                    _bytes.byte_view(full)[seg.tensor_offset : seg.tensor_offset + seg.nbytes],
                    view[seg.bucket_offset : seg.bucket_offset + seg.nbytes],
                )
                if seg.tensor_offset + seg.nbytes == e.nbytes:
                    ready.append((seg.index, assembling.pop(seg.index)))
            yield from ready

    def _kept_pairs(
        self, header: Header, manifest: Manifest, delta: bool, every: bool, deadline: Deadline
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """When the sender keeps a base: every bucket lands in (or, a delta, is applied to) this receiver's
        kept copy; tensors are views of it, all of them on a full sync, the changed ones on a delta."""
        plan = self._plan(manifest, header)
        entries = manifest.entries
        store = BufferStore(self._buffers.get("base", plan.total_bytes, self.device), plan)
        if delta:
            landed = self._delta_buckets(header, manifest, plan, store, self.device, deadline)
        else:
            rx = self._transport(header, plan, self.device, deadline)
            land = lambda k: Landed(store.view(k), Landing.STAGING)  # noqa: E731
            landed = ((k, [s.index for s in plan.buckets[k]]) for k, _, _ in self._buckets(
                header, plan, rx, land, deadline
            ))  # fmt: skip
        changed: set[int] = set()
        for k, hit in landed:
            changed.update(hit)
            for seg in plan.buckets[k]:
                i, e = seg.index, entries[seg.index]
                if seg.tensor_offset + seg.nbytes == e.nbytes and (every or i in changed):  # its last bytes
                    dtype = dtype_from_name(e.wire_dtype)
                    yield i, _bytes.typed_view(store.buffer, plan.offsets[i], dtype, e.shape)

    # ------------------------------------------------------------------ receive_into()

    def receive_into(
        self,
        target: Any,
        *,
        atomic: bool = True,
        allow_stale: bool = False,
        timeout: timedelta | None = None,
    ) -> int:
        """Receive the next version into ``target`` (a module or state dict) and return the version held.

        ``atomic=True`` stages the whole update (one model-size buffer) and copies into ``target`` only after
        every bucket arrived and the digests (when on) matched (a delta is applied to the staged copy of the
        version held, and only the tensors that changed are copied): on any failure ``target`` is
        bit-identical to before and ``version`` unchanged. ``atomic=False`` writes bucket by bucket
        (receiving straight into the target's storage where it is laid out as the plan is, e.g. after
        :func:`groupbridge.flatten_`); a failure then raises :class:`TornUpdateError` naming the tensors
        already written; a delta is applied to the target itself when its tensors are contiguous and in the
        wire dtype (otherwise every sync is a full one). ``timeout`` (default: the group's) bounds the whole
        sync. With deltas, the target must not be changed between syncs: its unchanged tensors are taken to
        hold the version last received (a target that differs is caught by the digests and raises).
        """
        deadline = self.group.deadline(timeout)
        targets = tensors_of(target, "receive_into()")
        expected = self.expected if self.expected is not None else expected_specs(targets)
        keep = ("atomic" if atomic else "streaming", tuple(t.data_ptr() for t in targets.values()))
        settled = self._settle(expected, allow_stale, None if atomic else targets, deadline, keep=keep)
        header, manifest = settled.header, settled.manifest
        plan = merged_plan(manifest) if settled.merged else self._plan(manifest, header)
        entries = manifest.entries
        dest = [targets.get(self._rename(e.name)) for e in entries]
        missing = [self._rename(e.name) for e, d in zip(entries, dest, strict=True) if d is None]
        if missing:  # only possible when expected= differs from the target
            err = WeightSyncError(f"target has no tensor named {', '.join(missing[:20])}")
            self._fail(err, f"receiving version {header.version}")
            raise err
        device = next((d.device for d in dest if d is not None), self.device)
        into = _Into(header, plan, manifest, dest, device, deadline, settled.delta)  # type: ignore[arg-type]
        self._held = None
        if atomic:
            self._receive_atomic(into)
        else:
            self._receive_streaming(into)
        self.version = header.version
        if header.delta and (
            atomic or all(_wire_typed(d, e) for d, e in zip(dest, entries, strict=True) if d is not None)
        ):
            self._held = (keep, header.version, manifest.digest)
        self._commit(header.version)
        return header.version

    def _receive_atomic(self, into: _Into) -> None:
        header, plan, manifest, dest, device, deadline, delta = into
        entries = manifest.entries
        staging = self._buffers.get("base" if header.delta else "staging", plan.total_bytes, device)
        store = BufferStore(staging, plan)
        changed: set[int] | None = set() if delta else None

        try:
            if changed is not None:
                for _, hit in self._delta_buckets(header, manifest, plan, store, device, deadline):
                    changed.update(hit)
            else:
                rx = self._transport(header, plan, device, deadline)
                land = lambda k: Landed(store.view(k), Landing.STAGING)  # noqa: E731
                for _ in self._buckets(header, plan, rx, land, deadline):
                    pass
        except BaseException as err:
            self._gave_up(err, f"receiving version {header.version}", WeightSyncError(
                f"receiving version {header.version} failed: {type(err).__name__}: {err}; the target is "
                f"untouched and the version held is still {self.version}"
            ))  # fmt: skip

        def apply() -> None:
            with torch.no_grad():
                for i, src_index in enumerate(manifest.sources):
                    src_entry = entries[src_index]
                    if src_entry.numel == 0 or (changed is not None and src_index not in changed):
                        continue
                    src = _bytes.typed_view(
                        staging,
                        plan.offsets[src_index],
                        dtype_from_name(src_entry.wire_dtype),
                        src_entry.shape,
                    )
                    if dest[i].data_ptr() != src.data_ptr():
                        dest[i].copy_(src)

        try:
            self._copier.run(apply)
        except BaseException as err:
            self._gave_up(err, f"applying version {header.version}", TornUpdateError(
                f"every byte of version {header.version} arrived, but copying it into the target failed: "
                f"{type(err).__name__}: {err}; the target is TORN; the version held is still {self.version}",
                written=[self._rename(e.name) for e in entries],
            ))  # fmt: skip

    def _receive_streaming(self, into: _Into) -> None:
        header, plan, manifest, dest, device, deadline, delta = into
        entries = manifest.entries
        if delta:
            self._receive_delta_into(into)
            return
        ring = self._ring(plan, device)
        wire_ok = [_wire_typed(d, e) for d, e in zip(dest, entries, strict=True)]
        direct: list[torch.Tensor | None] = [d if ok else None for d, ok in zip(dest, wire_ok, strict=True)]

        def land(k: int) -> Landed:
            view = _bytes.in_place_bucket(plan, k, direct, receiving=True)
            return Landed(view, Landing.TARGET) if view is not None else ring(k)

        written: list[str] = []
        partial: dict[int, torch.Tensor] = {}

        def unpack(k: int, view: torch.Tensor) -> None:
            for seg in plan.buckets[k]:
                e, d = entries[seg.index], dest[seg.index]
                if wire_ok[seg.index]:
                    out = _bytes.byte_view(d)
                else:
                    full = partial.setdefault(
                        seg.index, torch.empty(e.shape, dtype=dtype_from_name(e.wire_dtype))
                    )
                    out = _bytes.byte_view(full)
                if seg.tensor_offset == 0:
                    written.append(self._rename(e.name))
                out[seg.tensor_offset : seg.tensor_offset + seg.nbytes].copy_(
                    view[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
                )
                if seg.index in partial and seg.tensor_offset + seg.nbytes == e.nbytes:
                    d.copy_(partial.pop(seg.index))

        try:
            with torch.no_grad():
                rx = self._transport(header, plan, device, deadline)
                for k, view, in_place in self._buckets(header, plan, rx, land, deadline):
                    if in_place:
                        written.extend(
                            self._rename(entries[seg.index].name)
                            for seg in plan.buckets[k]
                            if seg.tensor_offset == 0
                        )
                    else:
                        self._copier.run(lambda k=k, view=view: unpack(k, view))  # type: ignore[misc]
                written += [self._rename(entries[i].name) for i in _fill_aliases(manifest, dest)]
        except BaseException as err:
            shown = ", ".join(written[:20]) + (
                f" ... and {len(written) - 20} more" if len(written) > 20 else ""
            )
            self._gave_up(err, f"receiving version {header.version}", TornUpdateError(
                f"receiving version {header.version} failed: {type(err).__name__}: {err}; the target is "
                f"TORN: {len(written)} of {len(entries)} tensors were (partly) overwritten "
                f"({shown or 'none'}); the version held is still {self.version}",
                written=written,
            ))  # fmt: skip

    def _receive_delta_into(self, into: _Into) -> None:
        """A streaming delta: applied to the target tensors themselves, bucket by bucket."""
        header, plan, manifest, dest, device, deadline, _ = into
        entries = manifest.entries
        written: list[str] = []
        changed: set[int] = set()
        try:
            with torch.no_grad():
                store = TargetStore(dest, plan, self._buffers)
                for _, hit in self._delta_buckets(header, manifest, plan, store, device, deadline):
                    written.extend(self._rename(entries[i].name) for i in hit if i not in changed)
                    changed.update(hit)
                written += [self._rename(entries[i].name) for i in _fill_aliases(manifest, dest, changed)]
        except BaseException as err:
            self._gave_up(err, f"receiving version {header.version}", TornUpdateError(
                f"receiving version {header.version} as a delta failed: {type(err).__name__}: {err}; the "
                f"target is TORN: {len(written)} tensors were changed ({', '.join(written[:20]) or 'none'}); "
                f"the version held is still {self.version}",
                written=written,
            ))  # fmt: skip


def _fill_aliases(manifest: Manifest, dest: list[torch.Tensor], only: set[int] | None = None) -> list[int]:
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


def _wire_typed(d: torch.Tensor, e: Any) -> bool:
    return d.is_contiguous() and d.dtype == dtype_from_name(e.wire_dtype)


class _Into(NamedTuple):
    """One ``receive_into`` after the handshake: what arrives, by which plan, into which tensors."""

    header: Header
    plan: Plan
    manifest: Manifest
    dest: list[torch.Tensor]
    device: torch.device
    deadline: Deadline
    delta: bool
    """The bytes travel as a delta against the version held."""


def _renamed(e: Any, rename: Callable[[str], str]) -> Any:
    from .manifest import Entry

    return Entry(rename(e.name), e.shape, e.dtype, e.wire_dtype, e.alias_of)
