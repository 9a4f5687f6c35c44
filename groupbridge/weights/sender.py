"""WeightSender: push named tensors from the sending rank to every receiver of a group."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from .._closing import Closing
from ..errors import (
    GroupBridgeError,
    PeerTimeoutError,
    SyncRefusedError,
    TransportUnavailableError,
    WeightSyncError,
)
from ..stateless import StatelessGroup
from . import _bytes
from ._copier import Copier
from ._delta_tx import DeltaSender
from ._described import Boxes, Described, NamedTensors, Specs, in_place, named_tensors_of, peek_device
from ._header import Header, check_version
from ._posts import Posts
from ._session import make_renamer, open_session, refuse
from ._sharded import boxes_of
from ._sharded_delta import Bases, DeltaMemory
from ._sharded_tx import SourceSlots
from ._source import Puller
from ._stats import SyncStats
from ._topology import Pairs
from ._tx_stream import Progress, Source, send_streams, source_sync
from .manifest import Manifest
from .plan import Plan, Plans
from .transports import (
    TRANSPORTS,
    Sync,
    TransportOptions,
    TxTransport,
    across_hosts,
    choose,
    stream_device,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "SyncStats", "WeightSender", "named_tensors_of"]

DEFAULT_BUCKET_BYTES = 64 << 20
"""Chosen by ``groupbridge bench --bucket-bytes 16MiB,64MiB,256MiB`` on 2 cores over gloo loopback: 16 MiB
pays per-operation overhead; 256 MiB helps only flattened models with one receiver and holds four times the
memory (two buckets on each side) while plain models with two receivers slowed; 64 MiB is the balance."""


class WeightSender(Closing):
    """Sends weights from this rank of ``group`` to every other rank, one bucket plan per manifest.

    Args:
        group: the bridge; this rank is the source.
        bucket_bytes: bucket size (default :data:`DEFAULT_BUCKET_BYTES`).
        solo_bytes: tensors at least this big travel in buckets of their own, straight from their storage
            (default ``bucket_bytes // 8``); smaller ones are packed together.
        transport: ``"auto"`` (same host: ``shm`` for CPU tensors, ``cuda_ipc`` for CUDA ones; across hosts
            ``broadcast`` or ``relay``, see ``transports.across_hosts``), or one by name: an explicit one that
            cannot work between these members raises, never falls back.
        transport_options: options of one transport or several (``RelayOptions(chain=..., chunk_bytes=...)``,
            ``BroadcastOptions(in_flight=...)``, ``SharedOptions(slots=...)``), checked against the group
            now; a transport not named here takes its defaults.
        wire_dtype: cast floating tensors to this dtype for the wire (fp32 master weights sent as bf16); an
            8-bit float is refused (the cast clips, silently; tensors already quantized travel as they are).
        checksum: send a checksum of every bucket; receivers verify before applying. ``True``: computed
            where the bytes are, XXH3-64 on the host for host tensors, ``"mix64"`` for tensors on an
            accelerator (``_device_digest``: torch operations on the device, no copy to the host); or
            either by name (``"xxh3"``, ``"mix64"``). A group with a token checks every bucket with its MAC
            instead, whatever this says.
        rename: a callable or mapping from the sender's names to the names on the wire.
        delta: send only what changed (compared bitwise: see :mod:`._delta`) since the version every
            receiver acknowledged, when that pays (see :class:`._delta_sync.Policy`; ``"always"``: every
            sync, even where the wire beats the diff, for tests); receivers check the result against the
            sender's digest of the new bytes (the sync's checksum, XXH3-64 where none was asked for, or the
            group's MAC; full syncs as ``checksum`` says).
            Costs one copy of the model's wire bytes here (``SyncStats.base_bytes``) and on receivers for
            ``receive()`` and atomic ``receive_into`` (a streaming one diffs against its target). A receiver
            holding another version, or a new group, makes the sync a full one for all.
        memory: with ``delta``, a :class:`~groupbridge.weights.DeltaMemory` kept across bridges (a new group
            per update): this sender starts from the bases the last one given it committed, and leaves its
            own there when closed.
        forward: with many sources across hosts, receivers pass this rank's cut on to each other where more
            want it than there are sources (its bytes leave this host once, every hop checked); False: each
            receiver takes it from here.
    """

    def __init__(
        self,
        group: StatelessGroup,
        *,
        bucket_bytes: int | None = None,
        solo_bytes: int | None = None,
        transport: str = "auto",
        wire_dtype: torch.dtype | None = None,
        checksum: bool | str = False,
        rename: Callable[[str], str] | Mapping[str, str] | None = None,
        transport_options: TransportOptions | Sequence[TransportOptions] | None = None,
        delta: bool | str = False,
        memory: DeltaMemory | None = None,
        forward: bool = True,
    ) -> None:
        if transport != "auto" and transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is not one of auto, {', '.join(TRANSPORTS)}")
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes < 1024):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an int >= 1024")
        if wire_dtype is not None and not wire_dtype.is_floating_point:
            raise ValueError(f"wire_dtype={wire_dtype} is not a floating dtype")
        if wire_dtype is not None and wire_dtype.itemsize == 1:
            raise ValueError(
                f"wire_dtype={wire_dtype} cannot carry weights: a cast to an 8-bit float clips every value "
                "past its range (bfloat16 1000.0 arrives as 448.0 in float8_e4m3fn) and the digests check "
                "the clipped bytes; send bfloat16 or float16, or quantize on purpose (with scales) and send "
                "the quantized tensors as they are"
            )
        if solo_bytes is not None and solo_bytes < 1:
            raise ValueError(f"solo_bytes={solo_bytes} must be >= 1")
        if delta not in (False, True, "always"):
            raise ValueError(f"delta={delta!r} must be False, True or 'always'")
        if checksum not in (False, True, "xxh3", "mix64"):
            raise ValueError(f"checksum={checksum!r} must be a bool, 'xxh3' or 'mix64'")
        if memory is not None and not isinstance(memory, DeltaMemory):
            raise TypeError(f"memory= takes a DeltaMemory, got {type(memory).__name__}")
        self.group = group
        self.src = group.rank
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        self.solo_bytes = solo_bytes if solo_bytes is not None else max(1, self.bucket_bytes // 8)
        self.transport = transport
        self.options = _options_by_transport(transport_options, group, self.src)
        """Every transport's options, completed for this group (e.g. the relay chain)."""
        self.wire_dtype = wire_dtype
        self.checksum = checksum
        self._transports: dict[str, TxTransport] = {}
        self._copier = Copier(f"{group.name}-{group.rank}")
        self._scratch = _bytes.BufferCache()
        self._kept = _bytes.Kept()
        self._boxes: tuple[Manifest, Boxes, dict[str, Any]] | None = None
        self._reserved: tuple[Manifest, Plan, str, Plan] | None = None
        """The last send's posted boxes and transport reservation, made again only when they change."""
        """Each pair bucket's pieces as views of its buffer, made once for the syncs that repeat a plan."""
        self._posts = Posts(group)
        self._described = Described(group, make_renamer(rename), wire_dtype)
        self._plans = Plans()
        self._memory = memory if delta else None
        self._bases = (memory.bases if memory is not None else Bases()) if delta else None
        """With ``delta``: the bytes this member last sent, one base per stream's cut (fan-out or pair)."""
        self._delta = (
            DeltaSender(group, self._copier, self._scratch, delta == "always", self._bases,
                        memory.policy if memory is not None else None)
            if self._bases is not None
            else None
        )  # fmt: skip
        self.forward = forward
        self.voted: int | None = None
        """The version of the last ``send`` when its vote passed, else None: every receiver that got past
        the vote holds it as its version from then on, whether or not it went on to acknowledge it (a
        receiver whose ``ready`` failed after the vote), and refuses a sync of that number again as not
        newer; a caller that numbers its own versions goes on above it."""
        self._sending = threading.Lock()
        self._closed = False

    @property
    def delta(self) -> bool:
        return self._delta is not None

    def _voted(self, version: int) -> None:
        self.voted = version

    def send(
        self,
        named_tensors: NamedTensors,
        version: int,
        *,
        specs: Specs | None = None,
        timeout: timedelta | None = None,
        progress: Progress | None = None,
    ) -> SyncStats:
        """Send ``named_tensors`` as ``version``; returns once every receiver confirmed it applied it.

        ``named_tensors`` is a Mapping, an ``nn.Module`` or an iterable of (name, tensor) pairs. An iterator
        is consumed lazily, so a generator gathering sharded parameters never holds the model; the manifest
        then comes from ``specs`` (name -> (shape, dtype), in order; (shape, dtype, global_shape, offset)
        for a box of a global tensor, yielded as a ``gb.Shard`` or a DTensor) or the previous send, and a
        first send with neither collects the iterator once. With many sources a lazy source's tensors are
        pulled as the buckets reading them are packed and let go after the last (a delta pair packs all its
        buckets first, holding what other pairs still need). ``progress(bytes_sent, total_bytes)`` is called
        after each bucket. ``timeout`` (default: the group's) bounds it all, to the last acknowledgement.

        Receivers apply the version only once every member voted its part succeeded (:mod:`._session`): a
        receiver that refuses the bytes or dies before the vote leaves every receiver on the version it held.
        A failure here once receivers are engaged (a transport error, the iterator or ``progress`` raising,
        an interrupt) aborts the group with the reason, so every receiver raises within the liveness
        timeout; a mistake found before the sync starts (bad names, an unusable transport) is told to the
        receivers as a refusal and leaves the group usable.

        Raises:
            ValueError, TypeError: bad arguments (receivers are told and raise WeightSyncError).
            ManifestMismatchError: a receiver expects other names, shapes or dtypes; nothing was sent.
            SyncRefusedError: every member ended the sync alike (a receiver refused it or its bytes).
            WeightSyncError: the transfer failed or a receiver reported a failure (the cause is chained).
        """
        if not self._sending.acquire(blocking=False):  # a second sync would interleave with the first's
            raise RuntimeError(f"a send is already running on this WeightSender (version {version} not sent)")
        try:
            with self.group.depending_on(range(self.group.world_size)):
                return self._send(named_tensors, version, specs, timeout, progress)
        finally:
            self._sending.release()

    def _send(
        self, named_tensors: NamedTensors, version: int, specs: Specs | None, timeout: timedelta | None,
        progress: Progress | None,
    ) -> SyncStats:  # fmt: skip
        self.voted = None
        deadline = self.group.deadline(timeout)
        self.group.check_open()
        self._copier.deadline = deadline
        self._kept.sweep()
        try:
            check_version(version)
            items, manifest, shards = self._described.describe(named_tensors, specs)
            items, device = peek_device(items)
            kind, cap = self._choose(device, manifest)
        except (ValueError, TypeError, TransportUnavailableError) as e:
            kind = "transport" if isinstance(e, TransportUnavailableError) else "input"
            refuse(self.group, f"{type(e).__name__}: {e}", deadline, kind)
            raise
        self._described.remember(manifest, shards)
        tx = self._tx(kind)
        plan = self._plan(manifest)
        header = Header(
            version, manifest.digest, self.bucket_bytes, self.solo_bytes, kind,
            verify_kind(self.group.sealed, self.checksum, stream_device(kind, device)), plan.total_bytes,
            secrets.token_hex(6), self.options[kind].to_wire(), tx.offer(),
            keeps_base=self._delta is not None,
            base=self._delta.offer(manifest) if self._delta is not None else None,
            pair_deltas=self._delta is not None and self._delta.policy.chose_delta,
            bucket_cap=cap, forward=self.forward,
        )  # fmt: skip
        try:
            session = open_session(
                self.group, deadline, self._posts, header=header, manifest=manifest,
                boxes=self._boxes_of(shards, manifest),
                in_place=in_place(items, manifest, self._delta is not None, self._plans), bases=self._bases,
                plans=self._plans, pays=self._delta.policy.pays if self._delta is not None else None,
            )  # fmt: skip
            carrier = session.topology.carrier(kind)
            if carrier != kind and self.transport != "auto":
                self.group.log.info("transport=%r carries one source's stream; this sync's pairs go over %s",
                                    self.transport, carrier)  # fmt: skip
            options = self.options[kind] if carrier == kind else TRANSPORTS[carrier].options()
            sync = Sync(header.sync_id, deadline, options, self._copier.copy)
            tx = self._tx(carrier)
            at = stream_device(carrier, device)
            replicas: Callable[[], Mapping[str, str]] | None = None
            cleanup: Callable[[], None] | None = None
            sample: Callable[[torch.Tensor, int], None] | None = None
            source: Source
            base: torch.Tensor | None = None
            if isinstance(session.topology, Pairs):  # pair streams, over the transport that carries them
                source = slots = SourceSlots(manifest, items, shards, session.pairs, self.src, self._kept)
                replicas, cleanup = partial(slots.replicas, deadline), slots.close
            else:
                source = puller = Puller(manifest, iter(items))
                if self._delta is not None:
                    base, sampled = self._delta.prepare(session, session.fanout, at)
                    sample = partial(self._delta.sample, puller, session.fanout) if sampled else None
            streams = session.streams(self.src, True, self._bases, at, base)
            workers = self._delta.workers() if self._delta is not None else [self._copier]
            send = partial(send_streams, self.group, session, streams, source, workers, self._scratch, tx,
                           sync, at, progress, sample)  # fmt: skip
            return source_sync(
                self.group,
                session,
                deadline,
                send,
                transport=carrier,
                bases=self._bases,
                policy=self._delta.policy if self._delta is not None else None,
                replicas=replicas,
                cleanup=cleanup,
                voted=self._voted,
            )
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

    def _tx(self, kind: str) -> TxTransport:
        tx = self._transports.get(kind)
        if tx is None:
            tx = self._transports[kind] = TRANSPORTS[kind].make_tx(self.group, self.options[kind])
        return tx

    def _choose(self, device: torch.device, manifest: Manifest) -> tuple[str, int]:
        """The transport for this sync, its resources claimed (where a same-host one cannot, ``auto`` falls
        back, a named one raises), and ``Header.bucket_cap``: what it reserved if it carries pairs, else 0."""
        kind = choose(self.transport, self.group, device)
        plan = self._plan(manifest)
        last = self._reserved
        if last is not None and last[:3] == (manifest, plan, kind):
            reserved = last[3]
        else:
            reserved = _reservation(plan, manifest, kind, self.bucket_bytes)
            self._reserved = (manifest, plan, kind, reserved)
        try:
            self._tx(kind).reserve(reserved, device)
        except TransportUnavailableError as e:
            if self.transport != "auto":
                raise
            fallback = across_hosts(self.group, device)
            self.group.log.warning("%s; using %s instead", e, fallback)
            return fallback, 0
        return kind, reserved.bucket_bytes if TRANSPORTS[kind].pairs else 0

    def _boxes_of(self, shards: Boxes, manifest: Manifest) -> dict[str, Any]:
        """The handshake's post of the boxes this source holds, made again only when they changed."""
        last = self._boxes
        if last is not None and last[0] is manifest and last[1] == shards:
            return last[2]
        post = boxes_of(shards, manifest)
        self._boxes = (manifest, shards, post)
        return post

    def _plan(self, manifest: Manifest) -> Plan:
        """The bucket plan, reused while the manifest is unchanged (building it walks every tensor)."""
        return self._plans.whole(manifest, self.bucket_bytes, self.solo_bytes)

    def close(self) -> None:
        """Release transport resources (shared slots, buffers) and the copy thread. The group stays open.
        Idempotent: with a ``memory``, what it keeps is written back once."""
        if self._closed:
            return
        self._closed = True
        for tx in self._transports.values():
            tx.close()
        self._transports.clear()
        self._copier.close()
        self._kept.clear()
        if self._delta is not None:
            if self._memory is not None:
                self._memory.policy = self._delta.policy
            self._delta.close()
        if self._bases is not None and self._memory is None:
            self._bases.clear()
        self._scratch.clear()


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
            raise TypeError(f"transport_options takes transport options (RelayOptions, BroadcastOptions, "
                            f"SharedOptions, P2POptions), got {type(opts).__name__}")  # fmt: skip
        for name in names:
            if name in chosen:
                raise ValueError(f"transport_options names {type(opts).__name__} twice")
            chosen[name] = opts
    return {
        name: chosen.get(name, spec.options()).resolved(group.world_size, src)
        for name, spec in TRANSPORTS.items()
    }


def _as_sync_error(e: BaseException, version: int) -> BaseException:
    """What a failed send raises, the group aborted: a :class:`WeightSyncError`, but a timeout stays a
    :class:`PeerTimeoutError` (a ``TimeoutError`` for generic handlers) and an interrupt propagates as is."""
    if isinstance(e, PeerTimeoutError):
        return PeerTimeoutError(f"sending version {version} timed out: {e}")
    if isinstance(e, WeightSyncError) or not isinstance(e, Exception):
        return e
    if isinstance(e, GroupBridgeError):
        return WeightSyncError(f"sending version {version} failed: {e}")
    return WeightSyncError(f"sending version {version} failed: {type(e).__name__}: {e}; the group is aborted")


def _reservation(plan: Plan, manifest: Manifest, kind: str, bucket_bytes: int) -> Plan:
    """What transport ``kind`` reserves for: the bucket plan, or, where it may carry pairs (known only after
    the handshake), a pair's biggest bucket: ``bucket_bytes`` or one tensor row, at most all bytes held."""
    if not TRANSPORTS[kind].pairs:
        return plan
    held = sum(-(-e.nbytes // 16) * 16 for e in manifest.entries if e.alias_of is None)
    row = max((e.nbytes // e.shape[0] for e in manifest.entries if e.shape and e.shape[0]), default=0)
    biggest = max((end - start for start, end in plan.bounds), default=0)
    return Plan.of_sizes([max(biggest, min(max(bucket_bytes, row), held))])


def verify_kind(sealed: bool, checksum: bool | str, device: torch.device) -> str:
    """How receivers check a sync's buckets (the header's ``verify``): the group's MAC when it is sealed,
    else the checksum asked for; ``True``: the one that runs where the sync's buckets are (``device``, see
    ``transports.stream_device``: a device's tensors sent over shared memory are packed into host memory)."""
    if sealed:
        return "blake3"
    if checksum is True:
        return "xxh3" if device.type == "cpu" else "mix64"
    return checksum or ""
