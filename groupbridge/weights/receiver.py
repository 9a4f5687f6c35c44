"""WeightReceiver: take weights from the sending members, streamed or all-or-nothing, verified on request.

Its handshake verdict is here; :mod:`._receive` takes what lands (a fan-out stream of whole tensors or pair
streams of boxes) through an :class:`._intake.Intake`, borrowing a :class:`._rx_stream.Taker`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from .._closing import Closing
from ..codec import dtype_from_name
from ..control import Deadline
from ..errors import WeightSyncError
from ..stateless import StatelessGroup
from . import _bytes
from ._copier import Copier
from ._header import Verdict
from ._intake import intake_into, intake_named
from ._posts import Posts
from ._receive import into, named
from ._rx_checks import Fits, Reads, Targets, refusal
from ._rx_stream import RxStreams, Taker
from ._session import Session, laid_out_in_place, make_renamer, open_session
from ._sharded_delta import FANOUT, DeltaMemory, kept_key
from ._topology import Pairs
from ._update import WeightUpdate
from .manifest import Manifest, expected_specs
from .plan import Plans
from .shard import Box

__all__ = ["WeightReceiver", "WeightUpdate"]


class WeightReceiver(Closing):
    """Receives the weights a sending member of ``group`` sends.

    Args:
        group: the bridge.
        src: the member expected to send (default: whichever member sends; the handshake finds it). A sync
            sent by another member is refused with a :class:`WeightSyncError` on every member.
        expected: the receiver's own module, state dict, or mapping name -> (shape, dtype), checked against
            the sender's manifest before any bytes move (default: ``receive_into``'s target).
        rename: a callable or mapping from names on the wire to this receiver's names.
        device: where received buckets land for ``receive()`` (default: CPU).
        buffers: receive buffers owned by the caller, kept across bridges so that a new bridge's first
            update lands in memory already touched, not page-faulting.
        memory: a :class:`~groupbridge.weights.DeltaMemory` kept across bridges (a new group per update): the
            version the last receiver given it held in full (and its buffers, unless ``buffers`` is given)
            is a base a sender's delta can be applied to.
    """

    def __init__(
        self,
        group: StatelessGroup,
        *,
        src: int | None = None,
        expected: Any = None,
        rename: Callable[[str], str] | Mapping[str, str] | None = None,
        device: str | torch.device = "cpu",
        buffers: _bytes.BufferCache | None = None,
        memory: DeltaMemory | None = None,
    ) -> None:
        if memory is not None and not isinstance(memory, DeltaMemory):
            raise TypeError(f"memory= takes a DeltaMemory, got {type(memory).__name__}")
        if src is not None and src == group.rank:
            raise ValueError(f"src={src} is this rank; the receiver must be another rank")
        self.group = group
        self.src = src
        self.expected = expected_specs(expected) if expected is not None else None
        self.version: int | None = None
        """The version last applied in full (None before the first)."""
        self.device = torch.device(device)
        self._copier = Copier(f"{group.name}-{group.rank}")
        self._streams = RxStreams(group, self._copier)
        self._rename = make_renamer(rename)
        self._renames = rename is not None
        self._posts = Posts(group)
        self._fits = Fits()
        self._targets: Targets | None = None
        """The last ``receive_into``'s target, as the handshake saw it (reused while it is the same)."""
        if buffers is None and memory is not None:
            buffers = memory.buffers
        self._buffers = buffers if buffers is not None else _bytes.BufferCache()
        self._own_buffers = buffers is None
        self._own_memory = memory is None
        self._memory = memory if memory is not None else DeltaMemory(buffers=self._buffers)
        """Delta bases, one per stream's cut: the caller's, if given, so that they outlive this group."""
        self._plans = Plans()
        self._bases = self._memory.bases
        self._reads: tuple[str, dict[str, Any]] | None = None
        self._receiving = threading.Lock()
        """Held from a receive's start to its end (an update's, until read to the end or dropped): a second
        receive would take the first's buckets."""
        """``receive(reads=...)``: (the sources' key, the wants to post) learned in the last handshake."""

    def _handshake(
        self, deadline: Deadline, *, expected: dict[str, tuple[tuple[int, ...], str]] | None,
        allow_stale: bool, keep: tuple[Any, ...], targets: dict[str, torch.Tensor] | None = None,
        accept: Callable[[Manifest], str | None] | None = None, wants: dict[str, Any] | None = None,
        wants_if: str | None = None, seen: Callable[[str, bool], None] | None = None,
    ) -> Session:  # fmt: skip
        """This receiver's part of the handshake: its verdict on the sources' headers and manifest."""
        check = partial(
            refusal,
            self.version,
            rename=self._rename,
            expected=expected,
            accept=accept,
            allow_stale=allow_stale,
            rank=self.group.rank,
            fits=self._fits,
        )

        def judge(draft: Session) -> Verdict:
            refused = check(draft.header, draft.manifest)
            if refused is not None:
                return refused
            for src in draft.feeding(self.group.rank):
                try:
                    problem = self._streams.attach(src, draft)
                except (ValueError, OSError, RuntimeError, WeightSyncError) as e:
                    problem = f"{type(e).__name__}: {e}"
                if problem is not None:
                    return Verdict(f"rank {self.group.rank}: {problem}", "transport")
            if isinstance(draft.topology, Pairs):  # its boxes are checked by the plan
                return Verdict()
            header, manifest = draft.header, draft.manifest
            dest = _dest(manifest, targets, self._rename) if targets is not None else None
            in_place = dest is not None and laid_out_in_place(
                self._plans.merged(manifest), dest, receiving=True
            )
            # the held tag names the version (a receiver of a new bridge, given a memory, has no version yet)
            base = (
                header.base is not None
                and self._bases.held(FANOUT, kept_key(keep, manifest.digest)) == header.base
            )
            return Verdict(in_place=in_place, base=base)

        return open_session(self.group, deadline, self._posts, wants=wants, wants_if=wants_if, seen=seen,
                            src=self.src, judge=judge, bases=self._bases,
                            plans=self._plans)  # fmt: skip

    def close(self) -> None:
        """Release transport mappings, buffers and the copy thread. The group stays open."""
        self._targets = None
        self._streams.close()
        self._buffers.kept.clear()  # views of this receiver's transports' memory (shared buffers or not)
        if self._own_buffers:
            self._buffers.clear()
        if self._own_memory:
            self._bases.clear()
        self._copier.close()

    def receive(
        self,
        *,
        allow_stale: bool = False,
        timeout: timedelta | None = None,
        accept: Callable[[Manifest], str | None] | None = None,
        only_changed: bool = True,
        keep: bool = False,
        reads: Callable[[Manifest], Mapping[str, Box | None]] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> WeightUpdate:
        """Start receiving the next version; the returned update yields (name, tensor) as buckets arrive.

        ``timeout`` (default: the group's) bounds the whole update, handshake and iteration.
        ``accept`` sees the (renamed) manifest before any bytes move and returns None to take it, or why
        not: every member then raises ManifestMismatchError with that message, the group usable (an engine
        dry-runs its loader here). Without targets, allocation follows the sender's announced sizes: a sync
        announcing more than this host's memory is refused on every member before anything is allocated;
        ``accept`` can set a tighter cap (``lambda m: "too big" if m.nbytes > cap else None``).
        ``only_changed=False``: a delta update yields every tensor (of the kept copy, delta applied), for a
        loader that needs whole layers; only the changes travel either way.
        ``keep=True``: buckets land in one buffer kept across syncs (the wire bytes in the plan's layout) and
        the update yields views of it, whole tensors never copied, valid until the next sync; as when the
        sender keeps a base (``update.kept``).
        ``reads`` (with ``keep``): after ``accept`` took a manifest, the box of each tensor the consumer
        reads, where not whole (a tensor-parallel worker's slice, learnt in a dry run). Later syncs from
        sources with the same manifests bring only those boxes (tensors still yielded whole-shaped, bytes
        outside a box as they were) where pairs travel as well as whole tensors (several sources, or ``shm``;
        not a one-source broadcast, relay or CUDA IPC). A dry run that then reads outside the boxes brought
        refuses the sync on every member; the next one brings what it reads now.
        ``ready``: called once the sync committed here (version held, every tensor yielded), before the
        sources are acknowledged, for what must finish before their ``send`` returns (an engine building a
        second copy of its model). If it raises, the sync fails for every member, as on an early stop.

        Raises:
            ManifestMismatchError: the manifest differs from ``expected``; nothing moved.
            WeightSyncError: the version is not newer than the one held (unless ``allow_stale``), or the
                sender refused the sync.
        """
        if reads is not None and (self._renames or not keep):
            raise ValueError("receive(reads=...) takes the names on the wire and keep=True")
        self._begin("receive()")
        self._targets = None  # a target of receive_into() is held no longer
        try:
            update = self._receive(allow_stale, timeout, accept, only_changed, keep, reads, ready)
        except BaseException:
            self._receiving.release()
            raise
        return update

    def _begin(self, what: str) -> None:
        if not self._receiving.acquire(blocking=False):
            raise RuntimeError(
                f"{what}: a receive is already running on this WeightReceiver (rank {self.group.rank}): read "
                "its update to the end, or close it, first"
            )

    def _receive(
        self,
        allow_stale: bool,
        timeout: timedelta | None,
        accept: Callable[[Manifest], str | None] | None,
        only_changed: bool,
        keep: bool,
        reads: Callable[[Manifest], Mapping[str, Box | None]] | None,
        ready: Callable[[], None] | None,
    ) -> WeightUpdate:
        deadline = self.group.deadline(timeout)
        self._copier.deadline = deadline
        self._buffers.kept.sweep()  # views the last sync did not use are let go
        learning = Reads(reads, self._reads, self.group.rank) if reads is not None else None
        posted = learning.posted if learning is not None else None
        try:
            with self.group.depending_on(range(self.group.world_size)):
                session = self._handshake(
                    deadline, expected=self.expected, allow_stale=allow_stale, keep=("receive",),
                    accept=learning.accepting(accept) if learning is not None else accept,
                    wants=posted[1] if posted else None, wants_if=posted[0] if posted else None,
                    seen=learning.seen if learning is not None else None,
                )  # fmt: skip
        finally:  # a refused sync still taught what the loader reads now
            if learning is not None:
                self._reads = learning.learned
        every = not (session.delta and only_changed)
        taker = self._taker(ready)
        only = set(posted[1]) if posted and learning is not None and learning.used else None
        intake = intake_named(taker, session, deadline, every, keep, only)
        pairs = _released(named(taker, session, intake, deadline), self._receiving)
        return WeightUpdate(session, pairs, self.group, kept=keep, unread=self._receiving.release)

    def _taker(self, ready: Callable[[], None] | None = None) -> Taker:
        """What a receive borrows; the fan-out base it rewrites holds no version until it commits."""
        self._bases.drop(FANOUT)

        def committed(version: int) -> None:
            self.version = version

        return Taker(self.group, self._streams, self._copier, self._buffers, self._memory, self._plans,
                     self._rename, self.version, committed, self.device, ready)  # fmt: skip

    def receive_into(
        self,
        target: Any,
        *,
        atomic: bool = True,
        allow_stale: bool = False,
        timeout: timedelta | None = None,
    ) -> int:
        """Receive the next version into ``target`` (a module or state dict) and return the version held.

        ``atomic=True`` stages the whole update (one model-size buffer; a delta applied to the staged copy)
        and copies into ``target`` (only changed tensors) once every bucket arrived and the digests (when on)
        matched: on any failure ``target`` is bit-identical to before and ``version`` unchanged.
        ``atomic=False`` writes bucket by bucket, straight into the target's storage where it is laid out as
        the plan is (:func:`groupbridge.flatten_`); a failure raises :class:`TornUpdateError` naming the
        tensors written. A delta is applied to the target itself when its tensors are contiguous and in the
        wire dtype (otherwise every sync is full). ``timeout`` (default: the group's) bounds the whole sync.
        With deltas, do not change the target between syncs: its unchanged tensors are taken to hold the
        version last received (one that differs is caught by the digests and raises). The receiver keeps the
        target's tensors until its next receive or :meth:`close`: a repeat sync into the same tensors reuses
        what it worked out from them (their boxes, shapes and addresses) instead of walking them again.
        """
        self._begin("receive_into()")
        try:
            return self._receive_into(target, atomic, allow_stale, timeout)
        finally:
            self._receiving.release()

    def _receive_into(self, target: Any, atomic: bool, allow_stale: bool, timeout: timedelta | None) -> int:
        deadline = self.group.deadline(timeout)
        self._copier.deadline = deadline
        self._buffers.kept.sweep()  # views the last sync did not use are let go
        targets = self._targets = Targets.of(target, self._renames, self._targets)
        expected = self.expected if self.expected is not None else targets.expected
        keep = ("atomic" if atomic else "streaming", targets.addresses)
        with self.group.depending_on(range(self.group.world_size)):
            session = self._handshake(
                deadline,
                expected=expected,
                allow_stale=allow_stale,
                keep=keep,
                targets=None if atomic else targets.named,
                wants=targets.wants,
            )
            taker = self._taker()
            intake = intake_into(taker, session, targets, atomic, deadline, keep)
            return into(taker, session, intake, deadline)


def _released(
    pairs: Generator[tuple[str, torch.Tensor], None, None], lock: threading.Lock
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """``pairs``, then ``lock`` released however it ends (read to the end, failed, closed or dropped)."""
    try:
        yield from pairs
    finally:
        lock.release()


def _dest(
    manifest: Manifest, targets: dict[str, torch.Tensor], rename: Callable[[str], str]
) -> list[torch.Tensor | None]:
    """The targets in manifest order, where they can take the wire bytes as they are."""
    dest: list[torch.Tensor | None] = []
    for e in manifest.entries:
        d = targets.get(rename(e.name))
        dest.append(d if d is not None and d.dtype == dtype_from_name(e.wire_dtype) else None)
    return dest
