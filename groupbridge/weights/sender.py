"""WeightSender: push named tensors from the sending rank to every receiver of a group."""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from ..control import Deadline
from ..errors import (
    GroupBridgeError,
    PeerTimeoutError,
    SyncRefusedError,
    TransportUnavailableError,
    WeightSyncError,
)
from ..stateless import StatelessGroup
from . import _bytes, _delta
from ._copier import Copier, Job
from ._delta_sync import Description, Policy, delta_digest, delta_groups, wire_plan, word_counts
from ._protocol import ACK_TAG, Header, laid_out_in_place, make_renamer, merged_plan, refuse, settle
from ._source import Puller
from .manifest import Manifest, tensors_of
from .plan import Plan, PlanCache
from .transports import TRANSPORTS, Sync, TransportOptions, TxTransport, across_hosts, choose

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BUCKET_BYTES", "SyncStats", "WeightSender", "named_tensors_of"]

DEFAULT_BUCKET_BYTES = 64 << 20
"""Chosen by ``groupbridge bench --bucket-bytes 16MiB,64MiB,256MiB`` on 2 cores over gloo loopback: 16 MiB
pays per-operation overhead; 256 MiB helps only flattened models with one receiver and holds four times the
memory (two buckets on each side) while plain models with two receivers slowed; 64 MiB is the balance."""


@dataclass(frozen=True, slots=True)
class SyncStats:
    version: int
    bytes: int
    seconds: float
    gbps: float
    """Payload gigabytes (1e9 bytes) per second, as seen by the sender."""
    buckets: int
    in_place_buckets: int
    """Buckets sent straight from the tensors' own storage, without packing."""
    transport: str
    receivers: int
    wire_bytes: int = 0
    """Payload bytes that travelled: ``bytes`` for a full sync, the changed buckets' encodings for a delta."""
    changed_fraction: float = 1.0
    """Of the words compared, the fraction that changed (1.0 for a full sync: nothing was compared)."""
    delta: bool = False
    """This sync travelled as a delta against the version every receiver held."""
    base_bytes: int = 0
    """Memory the sender holds for deltas (``WeightSender(delta=True)``): a copy of the model's wire bytes."""


def named_tensors_of(obj: Any) -> list[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]]:
    """Normalise a module, mapping or iterable of pairs; iterators stay lazy."""
    if isinstance(obj, (torch.nn.Module, Mapping)):
        return list(tensors_of(obj).items())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if isinstance(obj, Iterable):
        return iter(obj)
    raise TypeError(
        f"expected a module, a mapping or an iterable of (name, tensor), got {type(obj).__name__}"
    )


class WeightSender:
    """Sends weights from this rank of ``group`` to every other rank, one bucket plan per manifest.

    Args:
        group: the bridge; this rank is the source.
        bucket_bytes: bucket size (default :data:`DEFAULT_BUCKET_BYTES`).
        solo_bytes: tensors at least this big travel in buckets of their own, straight from their storage
            (default ``bucket_bytes // 8``); smaller ones are packed together.
        transport: ``"auto"`` (same host: ``shm`` for CPU tensors, ``cuda_ipc`` for CUDA tensors; across
            hosts ``broadcast`` up to two receivers, ``relay`` beyond), or one of them by name. An explicit
            transport that cannot work between these members raises, never falls back.
        transport_options: options of one transport or several (``RelayOptions(chain=..., chunk_bytes=...)``,
            ``BroadcastOptions(in_flight=...)``, ``SharedOptions(slots=...)``); each transport not named
            here takes its defaults. Checked against the group now.
        wire_dtype: cast floating tensors to this dtype for the wire (fp32 master weights sent as bf16).
        checksum: send an XXH3-64 checksum of every bucket (about 16 GB/s); receivers verify before applying.
        rename: a callable or mapping from the sender's names to the names on the wire.
        delta: send only what changed since the version every receiver acknowledged, when that pays (see
            :class:`._delta_sync.Policy`): buckets are compared bitwise and each travels as the smaller of
            its bytes and an encoding of its changed words; receivers apply it to the version they hold and
            check the result against the sender's digest of the new bytes (XXH3-64, or the group's MAC;
            full syncs are verified as ``checksum`` says). Costs one copy of the model's
            wire bytes on this rank (``SyncStats.base_bytes``) and, on receivers, one copy for ``receive()``
            and atomic ``receive_into`` (a streaming ``receive_into`` diffs against its target itself).
            A receiver that holds another version (it missed one, it is new) makes the sync a full one for
            all; so does a new group. ``"always"``
            diffs every sync, even where the wire is faster than the diff (tests, benchmarks).
        intra_op_threads: accepted for compatibility and ignored: bulk copies run on a thread the library
            owns, with one intra-op thread (see :mod:`._copier`); the caller's setting is never changed.
    """

    def __init__(
        self,
        group: StatelessGroup,
        *,
        bucket_bytes: int | None = None,
        solo_bytes: int | None = None,
        transport: str = "auto",
        wire_dtype: torch.dtype | None = None,
        checksum: bool = False,
        rename: Callable[[str], str] | Mapping[str, str] | None = None,
        intra_op_threads: int | None = 1,
        transport_options: TransportOptions | Sequence[TransportOptions] | None = None,
        delta: bool | str = False,
    ) -> None:
        if transport != "auto" and transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is not one of auto, {', '.join(TRANSPORTS)}")
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes < 1024):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an int >= 1024")
        if wire_dtype is not None and not wire_dtype.is_floating_point:
            raise ValueError(f"wire_dtype={wire_dtype} is not a floating dtype")
        self.group = group
        self.src = group.rank
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        if solo_bytes is not None and solo_bytes < 1:
            raise ValueError(f"solo_bytes={solo_bytes} must be >= 1")
        self.solo_bytes = solo_bytes if solo_bytes is not None else max(1, self.bucket_bytes // 8)
        self.transport = transport
        self.options = _options_by_transport(transport_options, group, self.src)
        """Every transport's options, completed for this group (e.g. the relay chain)."""
        self._transports: dict[str, TxTransport] = {}
        self.wire_dtype = wire_dtype
        self.checksum = checksum
        del intra_op_threads
        self._copier = Copier(f"{group.name}-{group.rank}")
        self._second: Copier | None = None
        self._scratch = _bytes.BufferCache()
        self._rename = make_renamer(rename)
        self._known: dict[str, Manifest] = {}
        self._manifest: Manifest | None = None
        self._plans = PlanCache()
        self._fault: Callable[[int, torch.Tensor], None] | None = None  # test hook: called per packed bucket
        if delta not in (False, True, "always"):
            raise ValueError(f"delta={delta!r} must be False, True or 'always'")
        self.delta = bool(delta)
        self._base: torch.Tensor | None = None
        """With ``delta``: the plan-layout bytes of ``_base_version`` (what every receiver acknowledged)."""
        self._base_version: int | None = None
        self._base_digest = ""
        self._policy = Policy(always=delta == "always")

    def send(
        self,
        named_tensors: Any,
        version: int,
        *,
        specs: Mapping[str, tuple[Any, torch.dtype]] | None = None,
        timeout: timedelta | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> SyncStats:
        """Send ``named_tensors`` as ``version``; returns once every receiver confirmed it applied it.

        ``named_tensors`` is a Mapping, an ``nn.Module`` or an iterable of (name, tensor) pairs. An iterator
        is consumed lazily, one tensor at a time, so a generator that gathers sharded parameters never holds
        the model: the manifest then comes from ``specs`` (name -> (shape, dtype), in order), or from the
        previous send; only a first send with neither collects the iterator once to describe it.
        ``progress(bytes_sent, total_bytes)`` is called after every bucket (for a progress bar).
        ``timeout`` (default: the group's) bounds the whole sync, handshake to last acknowledgement.

        One sync is one session: if anything fails on this side once receivers are engaged (a transport
        error, the source iterator raising, ``progress`` raising, an interrupt), the group is aborted with
        the reason, so every receiver raises within the group's liveness timeout instead of waiting. A
        mistake found before the sync starts (bad names, an unusable transport) is told to the receivers as
        a refusal and leaves the group usable.

        Raises:
            ValueError, TypeError: bad arguments (receivers are told and raise WeightSyncError).
            ManifestMismatchError: a receiver expects other names, shapes or dtypes; nothing was sent.
            WeightSyncError: the transfer failed or a receiver reported a failure (the cause is chained).
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        deadline = self.group.deadline(timeout)
        self.group.check_open()
        try:
            items, manifest = self._describe(named_tensors, specs)
            items, device = _peek_device(items)
            kind = self._choose(device, manifest)
        except (ValueError, TypeError, TransportUnavailableError) as e:
            kind = "transport" if isinstance(e, TransportUnavailableError) else "input"
            refuse(self.group, f"{type(e).__name__}: {e}", deadline, kind)
            raise
        self._manifest = manifest
        plan = self._plan(manifest)
        options: dict[str, Any] = {
            "sync_id": secrets.token_hex(6),
            "transport": self.options[kind].to_wire(),
        }
        verify = "hmac" if self.group.sealed else ("xxh3" if self.checksum else "")
        if self.delta:
            offer = self._base_version if self._base_digest == manifest.digest else None
            wants = self._policy.wants_delta()
            options["delta"] = {"base": offer if wants else None}
        header = Header(
            version, manifest.digest, self.bucket_bytes, self.solo_bytes, kind, verify,
            plan.total_bytes, options,
        )  # fmt: skip
        tx = self._tx(kind)
        try:
            return self._session(header, manifest, plan, items, device, tx, deadline, progress)
        except BaseException as e:
            if isinstance(e, SyncRefusedError):  # every member ended the sync alike: the group is fine
                raise
            self.group.abort(f"rank {self.src} gave up sending version {version}: {type(e).__name__}: {e}")
            err = _as_sync_error(e, version)
            try:
                if err is e:
                    raise
                raise err from e
            finally:  # no cycle through this frame: it would keep the sync's buffers until collected
                del err

    def _describe(self, named_tensors: Any, specs: Any) -> tuple[Any, Manifest]:
        items = named_tensors_of(named_tensors)
        if isinstance(items, list):
            items = [(self._rename(n), t) for n, t in items]
            return items, Manifest.build(items, self.wire_dtype)
        if specs is not None:
            meta = [
                (self._rename(n), torch.empty(tuple(s), dtype=d, device="meta"))
                for n, (s, d) in specs.items()
            ]
            return ((self._rename(n), t) for n, t in items), Manifest.build(meta, self.wire_dtype)
        if self._manifest is not None:
            return ((self._rename(n), t) for n, t in items), self._manifest
        logger.warning("first send of an iterator without specs=: collecting it once to build the manifest")
        items = [(self._rename(n), t) for n, t in items]
        return items, Manifest.build(items, self.wire_dtype)

    def _tx(self, kind: str) -> TxTransport:
        tx = self._transports.get(kind)
        if tx is None:
            tx = self._transports[kind] = TRANSPORTS[kind].make_tx(self.group, self.options[kind])
        return tx

    def _choose(self, device: torch.device, manifest: Manifest) -> str:
        """The transport for this sync, its resources claimed: ``auto`` falls back (and says why) when a
        same-host transport cannot get them; an explicit choice raises instead."""
        kind = choose(self.transport, self.group, device)
        try:
            self._tx(kind).reserve(self._plan(manifest), device)
        except TransportUnavailableError as e:
            if self.transport != "auto":
                raise
            fallback = across_hosts(self.group)
            logger.warning("[%s] %s; using %s instead", self.group.name, e, fallback)
            return fallback
        return kind

    def _session(
        self,
        header: Header,
        manifest: Manifest,
        plan: Plan,
        items: Any,
        device: torch.device,
        tx: TxTransport,
        deadline: Deadline,
        progress: Callable[[int, int], None] | None,
    ) -> SyncStats:
        version = header.version
        in_place_check = None if self.delta else self._in_place(items)
        settled = settle(self.group, self.src, header, manifest, self._known, None, in_place_check, deadline)
        if settled.merged:
            plan = merged_plan(manifest)
        t0 = time.perf_counter()
        sample = self.delta and self._base_version is not None and not settled.delta
        base = None
        if self.delta and (settled.delta or self._policy.keep_base()):
            base = self._keep_base(plan, device)
        elif self.delta:  # a full sync that does not refresh the base: the next one cannot be a delta
            self._base_version = None
        sync = Sync(header.sync_id, deadline, self.options[header.transport], self._copier.copy)
        if settled.delta:
            assert base is not None
            in_place, wire_bytes, changed = self._transfer_delta(
                tx, plan, manifest, Puller(manifest, iter(items)), base, sync, progress, delta_digest(header)
            )
        else:
            tx.setup(plan, device, sync)
            puller = Puller(manifest, iter(items))
            in_place, digests = self._transfer(tx, plan, puller, progress, header.verify, base, sample)
            if header.verify:
                self.group.broadcast_obj(digests, src=self.src, timeout=deadline)
            wire_bytes, changed = plan.total_bytes, 1.0
        failures = []
        for r in range(self.group.world_size):
            if r != self.src:
                ack = self.group.recv_obj(r, timeout=deadline, tag=ACK_TAG)
                if not isinstance(ack, dict) or ack.get("ok") is not True:
                    error = ack.get("error") if isinstance(ack, dict) else repr(ack)[:200]
                    failures.append(f"rank {r}: {error}")
        seconds = time.perf_counter() - t0
        if failures:  # every member finished the sync and said how: the group itself is fine
            raise SyncRefusedError(f"version {version} was not applied everywhere:\n" + "\n".join(failures))
        if self.delta:
            if base is not None:
                self._base_version, self._base_digest = version, manifest.digest
            if settled.delta:
                self._policy.record_delta(seconds, plan.total_bytes, wire_bytes, changed)
            else:
                self._policy.record_full(seconds, plan.total_bytes)
        stats = SyncStats(
            version=version,
            bytes=plan.total_bytes,
            seconds=seconds,
            gbps=plan.total_bytes / seconds / 1e9 if seconds > 0 else float("inf"),
            buckets=len(plan.buckets),
            in_place_buckets=in_place,
            transport=header.transport,
            receivers=self.group.world_size - 1,
            wire_bytes=wire_bytes,
            changed_fraction=changed,
            delta=settled.delta,
            base_bytes=0 if base is None else base.numel(),
        )
        logger.info(
            "[%s] sent version %d%s: %.1f MB (%.1f MB on the wire) in %.3fs (%.2f GB/s, %d buckets, %d in "
            "place, %s)",
            self.group.name, version, f" as a delta ({changed:.2%} changed)" if settled.delta else "",
            stats.bytes / 1e6, wire_bytes / 1e6, seconds, stats.gbps, stats.buckets, in_place,
            header.transport,
        )  # fmt: skip
        return stats

    def _keep_base(self, plan: Plan, device: torch.device) -> torch.Tensor:
        """The base buffer, invalid until this sync is acknowledged everywhere (a sync that fails midway
        leaves receivers on different versions: the next one is then a full sync)."""
        self._base_version = None
        base = self._base
        if base is None or base.numel() != plan.total_bytes or base.device != device:
            self._base = None  # free the old one first
            base = self._base = _bytes.new_buffer(plan.total_bytes, device)
        return base

    def _transfer_delta(
        self,
        tx: TxTransport,
        plan: Plan,
        manifest: Manifest,
        puller: Puller,
        base: torch.Tensor,
        sync: Sync,
        progress: Callable[[int, int], None] | None,
        verify: str,
    ) -> tuple[int, int, float]:
        """Diff every bucket against the base (bringing it up to the new version), describe, then send the
        changed buckets' payloads; returns (in-place buckets, wire bytes, changed fraction)."""
        sizes, words = word_counts(plan, manifest)
        n = len(plan.buckets)
        results: list[tuple[_delta.Encoded, Any, Any, bool] | None] = [None] * n
        biggest = max((e - s for s, e in plan.bounds), default=0)

        def diff(k: int, worker: int) -> tuple[_delta.Encoded, Any, Any, bool]:
            """On a copy thread, while the other diffs the next bucket and the caller's thread sends."""
            start, end = plan.bucket_range(k)
            new = _bytes.in_place_bucket(plan, k, puller.direct, receiving=False)
            flat = new is not None
            if new is None:
                new = self._scratch.get(f"delta-new{worker}", end - start, base.device)
                _bytes.pack(new, plan.buckets[k], puller.live, puller.wire)
            old = base[start:end]
            mask = self._scratch.get(f"delta-mask{worker}", biggest, base.device).view(torch.bool)
            enc = _delta.encode(new, old, sizes[k], mask)
            digest = _bytes.digest(old, verify, self.group)
            if enc.payload is not None:
                return enc, digest, _bytes.digest(enc.payload, verify, self.group), flat
            return enc, digest, digest if enc.code is _delta.Code.DENSE else None, flat

        workers = self._diff_workers()
        pending: deque[tuple[int, Job[Any]]] = deque()
        submitted = 0

        def result(k: int) -> tuple[_delta.Encoded, Any, Any, bool]:
            """Bucket k's diff; the workers are kept a few buckets ahead of the caller (the source's tensors
            are pulled here, on the caller's thread, and released once their buckets are diffed)."""
            nonlocal submitted
            while results[k] is None:
                while submitted < n and len(pending) < 2 * len(workers):
                    puller.pull_through(max(seg.index for seg in plan.buckets[submitted]))
                    w = submitted % len(workers)
                    pending.append((submitted, workers[w].submit(partial(diff, submitted, w))))
                    submitted += 1
                j, job = pending.popleft()
                results[j] = job.result()
                puller.release(plan, j)
                if progress is not None:
                    progress(plan.bucket_range(j)[1], plan.total_bytes)
            r = results[k]
            assert r is not None
            return r

        wire_bytes = changed = in_place = 0
        set_up = False
        for a, b in delta_groups(plan):
            done = [result(k) for k in range(a, b)]
            desc = Description(
                tuple(r[0].code for r in done),
                tuple(r[0].count for r in done),
                tuple(r[1] for r in done),
                tuple(r[2] for r in done if r[2] is not None),
            )
            self.group.broadcast_obj(desc.to_wire(), src=self.src, timeout=sync.deadline)
            wplan, sources = wire_plan(desc, sizes[a:b], words[a:b])
            changed += sum(r[0].count for r in done)
            in_place += sum(r[3] for r in done)
            wire_bytes += wplan.total_bytes
            if not sources:
                continue
            if set_up:
                tx.finish()  # the previous group's bytes are out; the diff workers kept going meanwhile
            tx.setup(wplan, base.device, sync)
            set_up = True
            for j, i in enumerate(sources):
                enc = done[i][0]
                start, end = plan.bucket_range(a + i)
                payload = enc.payload if enc.payload is not None else base[start:end]
                if self._fault is not None:
                    self._fault(a + i, payload)
                tx.post(j, payload)
        if set_up:
            tx.finish()
        puller.pull_through(len(manifest.entries) - 1)
        compared = sum(words)
        return in_place, wire_bytes, changed / compared if compared else 0.0

    def _in_place(self, items: Any) -> Callable[[Header, Manifest], bool]:
        def check(header: Header, manifest: Manifest) -> bool:
            if not isinstance(items, list) or any(e.dtype != e.wire_dtype for e in manifest.entries):
                return False
            return laid_out_in_place(manifest, [t for _, t in items], receiving=False)

        return check

    def _plan(self, manifest: Manifest) -> Plan:
        """The bucket plan, reused while the manifest is unchanged (building it walks every tensor)."""
        return self._plans.get(manifest, self.bucket_bytes, self.solo_bytes)

    def close(self) -> None:
        """Release transport resources (shared slots, buffers) and the copy thread. The group stays open."""
        for tx in self._transports.values():
            tx.close()
        self._transports.clear()
        self._copier.close()
        if self._second is not None:
            self._second.close()
        self._scratch.clear()
        self._base = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sample(self, old: torch.Tensor, plan: Plan, k: int, puller: Puller) -> None:
        """Pack bucket ``k`` into scratch and bring ``old`` (its base) up to it, diffing a slice on the
        way."""
        new = self._scratch.get("delta-new0", old.numel(), old.device)
        _bytes.pack(new, plan.buckets[k], puller.live, puller.wire)
        w = _delta.word_size(plan, puller.manifest, k)
        m = min(old.numel(), Policy.SAMPLE_BYTES) // w * w
        t0 = time.perf_counter()
        enc = _delta.encode(new[:m], old[:m], w)
        seconds = time.perf_counter() - t0
        wire = _delta.payload_nbytes(enc.code, enc.count, enc.words, w)
        self._policy.record_sample(seconds, m, enc.count / max(enc.words, 1), wire)
        old[m:].copy_(new[m:])

    def _diff_workers(self) -> list[Copier]:
        """Two copy threads diff buckets side by side (the diff is the sender's bottleneck and nothing else
        runs while it does: the transfer starts once every bucket is described)."""
        if self._second is None:
            self._second = Copier(f"{self.group.name}-{self.group.rank}-diff")
        return [self._copier, self._second]

    def _transfer(
        self,
        tx: TxTransport,
        plan: Plan,
        puller: Puller,
        progress: Callable[[int, int], None] | None,
        verify: str,
        base: torch.Tensor | None,
        sample: bool = False,
    ) -> tuple[int, list[Any]]:
        """Pack and post every bucket (into ``base`` too, when one is kept); returns (in-place buckets,
        digests)."""
        live = puller.live
        digests: list[Any] = []
        in_place = 0
        for k, segs in enumerate(plan.buckets):
            puller.pull_through(max(seg.index for seg in segs))
            start, end = plan.bucket_range(k)
            view = _bytes.in_place_bucket(plan, k, puller.direct, receiving=False)
            if view is not None:
                in_place += 1
                if base is not None:
                    self._copier.run(lambda v=view, b=base[start:end]: b.copy_(v))  # type: ignore[misc]
            elif base is not None and sample and end - start >= Policy.SAMPLE_BYTES // 2:
                sample = False  # one bucket per full sync is diffed against the base, to time the diff
                view = base[start:end]
                self._copier.run(partial(self._sample, view, plan, k, puller))
            else:
                device = live[segs[0].index].device  # type: ignore[union-attr]
                # a kept base is where the bucket is packed (one copy, not two); else the transport's buffer
                view = base[start:end] if base is not None else tx.buffer(k, end - start, device)
                self._copier.run(partial(_bytes.pack, view, segs, live, puller.wire))
            if verify:
                digests.append(_bytes.digest(view, verify, self.group))
            if self._fault is not None:
                self._fault(k, view)
            tx.post(k, view)
            if progress is not None:
                progress(end, plan.total_bytes)
            puller.release(plan, k)
        tx.finish()
        puller.pull_through(len(puller.entries) - 1)  # trailing aliases and empty tensors
        return in_place, digests


def _peek_device(
    items: list[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]], torch.device]:
    """The device the tensors live on (the first non-empty one's), without consuming a lazy source."""
    if isinstance(items, list):
        device = next((t.device for _, t in items if t.numel()), torch.device("cpu"))
        return items, device
    try:
        first = next(items)
    except StopIteration:
        return iter(()), torch.device("cpu")
    return itertools.chain([first], items), first[1].device


def _options_by_transport(
    given: TransportOptions | Sequence[TransportOptions] | None, group: StatelessGroup, src: int
) -> dict[str, TransportOptions]:
    """Each transport's options: the caller's where given, else its defaults; completed for ``group``."""
    items = [] if given is None else [given] if not isinstance(given, Sequence) else list(given)
    chosen: dict[str, TransportOptions] = {}
    for opts in items:
        names = getattr(type(opts), "transport", None)
        if not isinstance(names, tuple) or not all(
            TRANSPORTS.get(n) and TRANSPORTS[n].options is type(opts) for n in names
        ):
            raise TypeError(
                f"transport_options takes transport options (RelayOptions, BroadcastOptions, SharedOptions), "
                f"got {type(opts).__name__}"
            )
        for name in names:
            if name in chosen:
                raise ValueError(f"transport_options names {type(opts).__name__} twice")
            chosen[name] = opts
    out: dict[str, TransportOptions] = {}
    for name, spec in TRANSPORTS.items():
        out[name] = chosen.get(name, spec.options()).resolved(group.world_size, src)
    return out


def _as_sync_error(e: BaseException, version: int) -> BaseException:
    """What a failed send raises (the group is aborted by then): a :class:`WeightSyncError`, except that a
    timeout stays a :class:`PeerTimeoutError` (a ``TimeoutError`` for generic handlers) and an interrupt
    propagates unchanged."""
    if isinstance(e, PeerTimeoutError):
        return PeerTimeoutError(f"sending version {version} timed out: {e}")
    if isinstance(e, WeightSyncError) or not isinstance(e, Exception):
        return e
    if isinstance(e, GroupBridgeError):
        return WeightSyncError(f"sending version {version} failed: {e}")
    return WeightSyncError(f"sending version {version} failed: {type(e).__name__}: {e}; the group is aborted")
