"""WeightSender: push named tensors from the sending rank to every receiver of a group."""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..codec import dtype_from_name
from ..errors import GroupBridgeError, TransportUnavailableError, WeightSyncError
from ..stateless import StatelessGroup
from . import _bytes
from ._protocol import Header, make_renamer, merged_plan, refuse, settle
from .manifest import Manifest, tensors_of
from .plan import Plan
from .transports import TxTransport, choose, make_tx
from .transports.base import KINDS
from .transports.relay import DEFAULT_CHUNK_BYTES, default_chain

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BUCKET_BYTES", "SyncStats", "WeightSender", "named_tensors_of"]

DEFAULT_BUCKET_BYTES = 64 << 20
"""Chosen by ``groupbridge bench --bucket-bytes 16MiB,64MiB,256MiB`` on 2 cores over gloo loopback: 16 MiB
pays per-operation overhead; 256 MiB helps only flattened models with one receiver and holds four times the
memory (two buckets on each side) while plain models with two receivers slowed; 64 MiB is the balance."""

TRANSPORTS = ("auto", *KINDS)
ACK_TAG = "weights-ack"


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


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (process-wide, restored afterwards).

    On small machines the idle OpenMP workers of a packing copy spin and starve the transport's own threads;
    one intra-op thread during a sync avoids it. ``None`` leaves the setting alone.
    """
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if old != n:
            torch.set_num_threads(old)


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
        chain: the relay order (a list of ranks starting with this one; default: by rank).
        relay_chunk_bytes: chunk size the relay forwards at a time.
        wire_dtype: cast floating tensors to this dtype for the wire (fp32 master weights sent as bf16).
        checksum: send a CRC32 of every bucket; receivers verify before applying.
        rename: a callable or mapping from the sender's names to the names on the wire.
        intra_op_threads: torch intra-op threads during a sync (see :func:`intra_op_threads`); ``None``
            leaves the process setting alone.
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
        chain: list[int] | None = None,
        relay_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is not one of {', '.join(TRANSPORTS)}")
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
        self.chain = default_chain(group, self.src) if chain is None else list(chain)
        if sorted(self.chain) != list(range(group.world_size)) or self.chain[0] != self.src:
            raise ValueError(f"chain={chain} must start with this rank ({self.src}) and name every rank once")
        if relay_chunk_bytes < 1024:
            raise ValueError(f"relay_chunk_bytes={relay_chunk_bytes} must be >= 1024")
        self.relay_chunk_bytes = relay_chunk_bytes
        self._transports: dict[str, TxTransport] = {}
        self.wire_dtype = wire_dtype
        self.checksum = checksum
        self.threads = intra_op_threads
        self._rename = make_renamer(rename)
        self._known: dict[str, Manifest] = {}
        self._manifest: Manifest | None = None
        self._plan_cache: tuple[tuple[str, int, int], Plan] | None = None
        self._fault: Callable[[int, torch.Tensor], None] | None = None  # test hook: called per packed bucket

    def send(
        self,
        named_tensors: Any,
        version: int,
        *,
        specs: Mapping[str, tuple[Any, torch.dtype]] | None = None,
        timeout: timedelta | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> SyncStats:
        """Send ``named_tensors`` as ``version``; returns once every receiver confirmed.

        ``named_tensors`` is a Mapping, an ``nn.Module`` or an iterable of (name, tensor) pairs. An iterator
        is consumed lazily, one tensor at a time, so a generator that gathers sharded parameters never holds
        the model: the manifest then comes from ``specs`` (name -> (shape, dtype), in order), or from the
        previous send; only a first send with neither collects the iterator once to describe it.
        ``progress(bytes_sent, total_bytes)`` is called after every bucket (for a progress bar).

        Raises:
            ManifestMismatchError: a receiver expects other names, shapes or dtypes; nothing was sent.
            WeightSyncError: the transfer failed or a receiver reported a failure.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        items = named_tensors_of(named_tensors)
        if isinstance(items, list):
            items = [(self._rename(n), t) for n, t in items]
            manifest = Manifest.build(items, self.wire_dtype)
        elif specs is not None:
            meta = [
                (self._rename(n), torch.empty(tuple(s), dtype=d, device="meta"))
                for n, (s, d) in specs.items()
            ]
            manifest = Manifest.build(meta, self.wire_dtype)
            items = ((self._rename(n), t) for n, t in items)
        elif self._manifest is not None:
            manifest = self._manifest
            items = ((self._rename(n), t) for n, t in items)
        else:
            logger.warning(
                "first send of an iterator without specs=: collecting it once to build the manifest"
            )
            items = [(self._rename(n), t) for n, t in items]
            manifest = Manifest.build(items, self.wire_dtype)
        self._manifest = manifest
        items, device = _peek_device(items)
        try:
            kind = choose(self.transport, self.group, device)
        except TransportUnavailableError as e:
            refuse(self.group, str(e))
            raise
        plan = self._plan(manifest)
        options: dict[str, Any] = {
            "sync_id": secrets.token_hex(6),
            "chain": self.chain,
            "chunk_bytes": self.relay_chunk_bytes,
        }
        header = Header(
            version, manifest.digest, self.bucket_bytes, self.solo_bytes, kind, self.checksum,
            plan.total_bytes, options,
        )  # fmt: skip
        tx = self._transports.get(kind)
        if tx is None:
            tx = self._transports[kind] = make_tx(kind, self.group)

        with intra_op_threads(self.threads):
            _, _, merged = settle(
                self.group, self.src, header, manifest, self._known, None, self._in_place(items)
            )
            if merged:
                plan = merged_plan(manifest)
            t0 = time.perf_counter()
            try:
                tx.setup(plan, device, dict(options, timeout=timeout))
                in_place, crcs = self._transfer(tx, plan, manifest, iter(items), progress)
                if self.checksum:
                    self.group.broadcast_obj(crcs, src=self.src)
            except GroupBridgeError as e:
                raise WeightSyncError(f"sending version {version} failed: {e}") from e
            failures = []
            for r in range(self.group.world_size):
                if r != self.src:
                    ack = self.group.recv_obj(r, timeout=timeout, tag=ACK_TAG)
                    if not ack.get("ok"):
                        failures.append(f"rank {r}: {ack.get('error')}")
            seconds = time.perf_counter() - t0
        if failures:
            raise WeightSyncError(f"version {version} was not applied everywhere:\n" + "\n".join(failures))
        stats = SyncStats(
            version=version,
            bytes=plan.total_bytes,
            seconds=seconds,
            gbps=plan.total_bytes / seconds / 1e9 if seconds > 0 else float("inf"),
            buckets=len(plan.buckets),
            in_place_buckets=in_place,
            transport=kind,
            receivers=self.group.world_size - 1,
        )
        logger.info(
            "[%s] sent version %d: %.1f MB in %.3fs (%.2f GB/s, %d buckets, %d in place, %s)",
            self.group.name, version, stats.bytes / 1e6, seconds, stats.gbps, stats.buckets,
            in_place, kind,
        )  # fmt: skip
        return stats

    def _in_place(self, items: Any) -> Callable[[Header, Manifest], bool]:
        def check(header: Header, manifest: Manifest) -> bool:
            if not isinstance(items, list) or any(e.dtype != e.wire_dtype for e in manifest.entries):
                return False
            plan = merged_plan(manifest)
            tensors: list[torch.Tensor | None] = [t for _, t in items]
            return all(_bytes.in_place_bucket(plan, k, tensors, receiving=False) is not None
                       for k in range(len(plan.buckets)))  # fmt: skip

        return check

    def _plan(self, manifest: Manifest) -> Plan:
        """The bucket plan, reused while the manifest is unchanged (building it walks every tensor)."""
        key = (manifest.digest, self.bucket_bytes, self.solo_bytes)
        if self._plan_cache is None or self._plan_cache[0] != key:
            self._plan_cache = (key, Plan.build(manifest, self.bucket_bytes, self.solo_bytes))
        return self._plan_cache[1]

    def close(self) -> None:
        """Release transport resources (shared slots, buffers). The group stays open."""
        for tx in self._transports.values():
            tx.close()
        self._transports.clear()

    def _transfer(
        self,
        tx: TxTransport,
        plan: Plan,
        manifest: Manifest,
        items: Iterator[tuple[str, torch.Tensor]],
        progress: Callable[[int, int], None] | None,
    ) -> tuple[int, list[int]]:
        entries = manifest.entries
        live: list[torch.Tensor | None] = [None] * len(entries)
        last_bucket = [-1] * len(entries)
        for k, segs in enumerate(plan.buckets):
            for seg in segs:
                last_bucket[seg.index] = k
        pulled = 0

        def pull_through(index: int) -> None:
            nonlocal pulled
            while pulled <= index:
                try:
                    name, t = next(items)
                except StopIteration:
                    raise ValueError(
                        f"the named tensors ended after {pulled} of {len(entries)} entries of the manifest"
                    ) from None
                e = entries[pulled]
                if (
                    name != e.name
                    or tuple(t.shape) != e.shape
                    or str(t.dtype).removeprefix("torch.") != e.dtype
                ):
                    raise ValueError(
                        f"tensor #{pulled} is {name!r} {list(t.shape)} {t.dtype}; the manifest says "
                        f"{e.name!r} {list(e.shape)} {e.dtype} (the order and shapes must not change)"
                    )
                if e.alias_of is None and e.nbytes:
                    src = t.detach()
                    wire = dtype_from_name(e.wire_dtype)
                    if src.dtype != wire:
                        src = src.to(wire)
                    live[pulled] = src.contiguous()
                pulled += 1

        crcs: list[int] = []
        in_place = 0
        for k, segs in enumerate(plan.buckets):
            pull_through(max(seg.index for seg in segs))
            start, end = plan.bucket_range(k)
            view = _bytes.in_place_bucket(plan, k, live, receiving=False)
            if view is not None:
                in_place += 1
            else:
                device = live[segs[0].index].device  # type: ignore[union-attr]
                view = tx.buffer(k, end - start, device)  # waits until the buffer is free again
                for seg in segs:
                    src = _bytes.byte_view(live[seg.index])  # type: ignore[arg-type]
                    view[seg.bucket_offset : seg.bucket_offset + seg.nbytes].copy_(
                        src[seg.tensor_offset : seg.tensor_offset + seg.nbytes]
                    )
            if self.checksum:
                crcs.append(_bytes.checksum(view))
            if self._fault is not None:
                self._fault(k, view)
            tx.post(k, view)
            if progress is not None:
                progress(end, plan.total_bytes)
            for seg in segs:
                if last_bucket[seg.index] == k:
                    live[seg.index] = None  # a lazy source's tensor is released as soon as it is sent
        tx.finish()
        pull_through(len(entries) - 1)  # trailing aliases and empty tensors
        return in_place, crcs


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
