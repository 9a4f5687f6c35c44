"""The trainer side of backend ``"groupbridge"``: host the bridge, send every step, drive vLLM's RPCs.

``trainer_init`` and ``send_weights`` run on every trainer rank; rank 0 sends. Non-sender ranks iterate the
source (its gathers are collectives) and drop what it yields. On the sender one ``send_weights`` is:

1. on a side thread, ``client.start_weight_update()`` then ``client.update_weights({"version": v})``: each
   vLLM worker enters the bridge's handshake, where it dry-runs the manifest through its model's loader;
2. here, :meth:`groupbridge.WeightSender.send`, which returns once every worker acknowledged the bytes
   (atomic: staged, the model untouched; streaming: loaded);
3. ``client.finish_weight_update(weight_version=str(v))``: atomic workers load what they staged, and vLLM
   starts serving version ``v``.

A failure on either side ends both: a worker that refuses or fails makes ``send`` raise (a refusal before
bytes move is the same ``ManifestMismatchError`` on every member and the bridge stays usable); a client call
that fails while the workers are still away aborts the bridge so nothing waits out its timeout. After an
abort the next ``send_weights`` opens a new bridge (a new generation) through
``init_weight_transfer_engine``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo as _VllmTrainerInitInfo
from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from ..errors import GroupBridgeError, SyncRefusedError, WeightSyncError
from ..net import Address, Listener, listen
from ..stateless import StatelessGroup
from ..weights.sender import SyncStats, WeightSender
from ..weights.transports import TRANSPORTS
from ._plugin import BACKEND
from ._worker import WorkerInitInfo, check_seconds

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)


@dataclass
class TrainerInitInfo(_VllmTrainerInitInfo):
    """How the trainer hosts the bridge to vLLM (``backend = "groupbridge"``).

    Attributes:
        host: the address the trainer binds and the workers dial: IPv4, IPv6 or a host name (default
            loopback). The socket is bound before its port is told to anyone.
        port: 0 lets the kernel pick a free port.
        workers: how many vLLM worker processes join: data parallel x tensor parallel x pipeline parallel,
            summed over every engine the client drives.
        transport: ``"auto"`` (shared memory on one CPU host, CUDA IPC on one GPU host, broadcast or relay
            across hosts) or one by name.
        atomic: stage the whole update and load it only once every worker has every byte (a trainer dying
            midway leaves vLLM serving the old weights); False streams buckets into ``load_weights``.
        token: a shared secret: members prove it at join and every bucket carries a MAC.
        timeout: seconds that bound each whole update (and joining).
        liveness: seconds after which a silent peer counts as gone.
        checksum: XXH3-64 checksum of every bucket, verified before the update is loaded (implied by a token).
        bucket_bytes: bucket size (None: the library's default).
        first_version: the version of the first ``send_weights`` (then +1 each time).
        delta: send only what changed since the version every worker holds, where that pays (``True``) or
            always (``"always"``); see :class:`groupbridge.WeightSender`. Workers then keep one copy of the
            model's wire bytes (the update is loaded from it, so atomic updates need no other staging).
        sources: trainer ranks that send, ranks 0 .. sources-1. With 1, rank 0 sends whole tensors (the
            other ranks drive the source's gathers). With more, every one of them joins the bridge and sends
            what it holds: an FSDP2 module's DTensor parameters as their local boxes, ``gb.Shard`` values
            of a custom source as theirs; no rank gathers the model, and the workers assemble whole tensors
            from every rank (one commit for all). Rank 0 hosts the bridge and drives vLLM; the others dial
            it at ``host``/``port``. Bind rank 0's socket first (``lis = gb.listen(host, 0)``), pass it as
            ``listener=`` on rank 0 and ``lis.port`` to the others (e.g. with torch.distributed's
            ``broadcast_object_list``): every rank's ``trainer_init`` returns once all have joined. A bridge
            that breaks then needs new engines on every rank.
        listener: on rank 0, a socket bound beforehand (see ``sources``); the first bridge is served on it.
    """

    backend: ClassVar[str] = BACKEND

    host: str = "127.0.0.1"
    port: int = 0
    workers: int = 1
    transport: str = "auto"
    atomic: bool = True
    token: str | None = None
    timeout: float = 300.0
    liveness: float = 10.0
    checksum: bool = True
    bucket_bytes: int | None = None
    first_version: int = 1
    name: str = field(default="vllm")
    delta: bool | str = False
    sources: int = 1
    listener: Listener | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} must be >= 1 (the number of vLLM worker processes)")
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of auto, {', '.join(TRANSPORTS)}")
        check_seconds(timeout=self.timeout, liveness=self.liveness)
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} is not a TCP port (0: the kernel picks one)")
        if not isinstance(self.sources, int) or self.sources < 1:
            raise ValueError(f"sources={self.sources!r} must be >= 1 (the trainer ranks that send)")
        if 0 < self.rank < self.sources and self.port == 0:
            raise ValueError(
                f"rank {self.rank} of {self.sources} sending trainer ranks dials rank 0's bridge: pass "
                "port= (rank 0's engine.address.port)"
            )
        if self.delta not in (False, True, "always"):
            raise ValueError(f"delta={self.delta!r} must be False, True or 'always'")


class TrainerEngine(TrainerWeightTransferEngine[TrainerInitInfo]):
    """Trainer engine of backend ``"groupbridge"`` (see the module docstring)."""

    init_info_cls = TrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        info: TrainerInitInfo | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info if info is not None else TrainerInitInfo(rank=0 if is_sender else 1)
        self.group: StatelessGroup | None = None
        self.sender: WeightSender | None = None
        self.generation = 0
        self.version: int | None = None
        """The last version vLLM confirmed serving."""
        self.last_stats: SyncStats | None = None
        self.last_seconds: dict[str, float] = {}
        """Wall time of the last ``send_weights``, split: ``transfer`` (to every worker's acknowledgement),
        ``finish`` (``finish_weight_update``: the atomic load), ``total``."""

    @classmethod
    def trainer_init(
        cls,
        init_info: TrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if not isinstance(init_info, TrainerInitInfo):
            raise TypeError(
                f"init_info must be groupbridge.vllm.TrainerInitInfo, got {type(init_info).__name__}"
            )
        if source is None:
            raise ValueError("backend 'groupbridge' sends a WeightSource each step: pass source=")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            engine.connect()
        elif engine.info.rank < engine.info.sources:
            engine.join()
        return engine

    @property
    def address(self) -> Address | None:
        """The bridge's address (rank 0, once connected): what the other sending ranks dial."""
        return self.group.address if self.group is not None else None

    def join(self) -> None:
        """A sending rank other than 0: join rank 0's bridge (its first generation) and send from it."""
        info = self.info
        self.generation = 1
        self.group = StatelessGroup.create(
            info.host, info.port, rank=info.rank, world_size=info.workers + info.sources, name=info.name,
            generation=self.generation, timeout=timedelta(seconds=info.timeout),
            liveness_timeout=timedelta(seconds=info.liveness), token=info.token,
        )  # fmt: skip
        self.sender = WeightSender(self.group, checksum=info.checksum, bucket_bytes=info.bucket_bytes)

    # ------------------------------------------------------------------ session

    def connect(self) -> None:
        """Host a new bridge (the next generation) and have every vLLM worker join it."""
        self.shutdown()
        info = self.info
        self.generation += 1
        given, info.listener = info.listener, None  # served once: a later bridge binds a new socket
        lis = given if given is not None else listen(info.host, info.port)
        # built (and checked) here, sent as plain JSON: the worker parses the same dataclass
        worker_info = dataclasses.asdict(
            WorkerInitInfo(
                host=lis.address.host,
                port=lis.port,
                world_size=info.workers + info.sources,
                sources=info.sources,
                name=info.name,
                generation=self.generation,
                token=info.token,
                atomic=info.atomic,
                timeout_s=info.timeout,
                liveness_s=info.liveness,
            )
        )
        call = _Call(
            "init_weight_transfer_engine", lambda: self.client.init_weight_transfer_engine(worker_info)
        )
        try:
            self.group = StatelessGroup.create(
                None,
                rank=0,
                world_size=info.workers + info.sources,
                listener=lis,
                name=info.name,
                generation=self.generation,
                timeout=timedelta(seconds=info.timeout),
                liveness_timeout=timedelta(seconds=info.liveness),
                token=info.token,
            )
        except BaseException as e:
            lis.close()
            call.join(info.liveness)
            if call.error is not None:
                raise WeightSyncError(f"vLLM's init_weight_transfer_engine failed: {call.error}") from e
            raise
        call.join(info.timeout)
        call.result()
        self.sender = WeightSender(
            self.group,
            transport=info.transport,
            checksum=info.checksum,
            bucket_bytes=info.bucket_bytes,
            delta=info.delta,
        )

    def shutdown(self) -> None:
        """Close the bridge; vLLM's workers are told to leave it first (``shutdown_weight_transfer_engine``,
        when the client has it), so that none is left holding a group whose host is gone."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.group is None:
            return
        group, self.group = self.group, None
        leave = getattr(self.client, "shutdown_weight_transfer_engine", None)
        call = _Call("shutdown_weight_transfer_engine", leave) if callable(leave) and _usable(group) else None
        group.close()  # the host waits (bounded) for the members to close theirs
        if call is not None:
            call.join(self.info.liveness)
            if call.error is not None or call.running:
                logger.warning(
                    "groupbridge: vLLM's shutdown_weight_transfer_engine: %s", call.error or "no answer"
                )

    # ------------------------------------------------------------------ one step

    def send_weights(self, version: int | None = None) -> None:
        """Send the source's weights as the next version (or ``version``) and make vLLM serve them."""
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            if self.info.rank < self.info.sources:
                self._send_my_shards(version)
            elif self.info.sources == 1:
                for _ in self.source:  # drive the source's gathers (collectives); the sender ships them
                    pass
            return
        v = (
            version
            if version is not None
            else (self.version + 1 if self.version is not None else self.info.first_version)
        )
        if self.version is not None and v <= self.version:
            raise ValueError(f"version {v} is not newer than the version vLLM serves ({self.version})")
        if self.group is None or not _usable(self.group):
            self.connect()
        assert self.sender is not None and self.group is not None
        specs = {m.name: (m.shape, m.dtype) for m in meta}
        t0 = time.perf_counter()
        group = self.group

        def drive() -> None:
            _start(self.client)
            self.client.update_weights({"version": v})

        call = _Call(
            "start_weight_update/update_weights",
            drive,
            on_error=lambda e: _abort_later(group, e, self.info.liveness),
        )
        try:
            named = self._held() if self.info.sources > 1 else iter(self.source)
            stats = self.sender.send(named, v, specs=specs, timeout=timedelta(seconds=self.info.timeout))
        except GroupBridgeError as e:
            call.join(self.info.liveness + 5)
            if isinstance(e, SyncRefusedError) or call.error is None:
                raise
            raise WeightSyncError(f"vLLM failed the update of version {v}: {call.error}") from e
        finally:
            call.cancel_abort()
        call.join(self.info.timeout)
        call.result()
        t1 = time.perf_counter()
        try:
            self.client.finish_weight_update(weight_version=str(v))
        except Exception as e:
            raise WeightSyncError(
                f"vLLM's finish_weight_update failed for version {v}: {type(e).__name__}: {e}; vLLM still "
                f"reports the version it served before"
            ) from e
        t2 = time.perf_counter()
        self.version = v
        self.last_stats = stats
        self.last_seconds = {"transfer": t1 - t0, "finish": t2 - t1, "total": t2 - t0}

    def _held(self) -> dict[str, Any]:
        """What this rank holds of the source, never gathered: a module's parameters (DTensors are sent as
        their local boxes), else the source's own pairs (``gb.Shard`` values are boxes)."""
        assert self.source is not None
        module = getattr(self.source, "_module", None)  # vLLM's ModuleSource
        if isinstance(module, torch.nn.Module):
            return dict(module.named_parameters())
        return dict(iter(self.source))

    def _send_my_shards(self, version: int | None) -> None:
        """A sending rank other than 0: its part of the sync rank 0 drives (the versions advance alike)."""
        if self.sender is None or self.group is None or not _usable(self.group):
            raise WeightSyncError(
                f"trainer rank {self.info.rank}: the bridge broke; with several sending ranks, make new "
                "engines on every rank"
            )
        v = version if version is not None else (self.version + 1 if self.version is not None else
                                                  self.info.first_version)  # fmt: skip
        self.last_stats = self.sender.send(self._held(), v, timeout=timedelta(seconds=self.info.timeout))
        self.version = v


def _usable(group: StatelessGroup) -> bool:
    try:
        group.check_open()
    except GroupBridgeError:
        return False
    return True


def _start(client: VLLMWeightSyncClient) -> None:
    """``start_weight_update``, recovering an engine that a trainer left mid-update (it died between vLLM's
    ``start_weight_update`` and the end of the update: vLLM then refuses every new start, and has no abort).
    Our workers drop whatever an earlier session received when a new one joins, so finishing that update
    commits nothing; then the start is tried again. Any other failure is raised as it was."""
    try:
        client.start_weight_update()
        return
    except Exception as e:
        first = e
    try:
        client.finish_weight_update(weight_version=None)
    except Exception:  # not a leftover update: the start failed for its own reason
        raise first from None
    logger.warning(
        "groupbridge: vLLM was left mid-update by an earlier trainer (%s); finished it without loading "
        "anything and started this update", first,
    )  # fmt: skip
    client.start_weight_update()


def _abort_later(group: StatelessGroup, error: BaseException, grace: float) -> Callable[[], None]:
    """Abort ``group`` unless the sync ends on its own within ``grace`` seconds (a worker's refusal reaches
    the sender through the bridge too, and must not be turned into an abort). Returns a canceller."""
    cancelled = threading.Event()

    def run() -> None:
        if not cancelled.wait(grace):
            group.abort(f"vLLM's side of the update failed: {type(error).__name__}: {error}")

    threading.Thread(target=run, name="groupbridge-vllm-abort", daemon=True).start()
    return cancelled.set


class _Call:
    """``fn`` on a daemon thread, so the trainer can send while vLLM's RPC waits for the bytes."""

    def __init__(
        self,
        what: str,
        fn: Callable[[], None],
        on_error: Callable[[BaseException], Callable[[], None]] | None = None,
    ) -> None:
        self.what = what
        self.error: BaseException | None = None
        self._cancel: Callable[[], None] | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        self._on_error = on_error

        def run() -> None:
            try:
                fn()
            except BaseException as e:
                self.error = e
                with self._lock:  # after cancel_abort(), a late failure arms nothing (a retry is not aborted)
                    if self._on_error is not None and not self._cancelled:
                        self._cancel = self._on_error(e)

        self._thread = threading.Thread(target=run, name=f"groupbridge-vllm-{what}", daemon=True)
        self._thread.start()

    def join(self, seconds: float) -> None:
        self._thread.join(seconds)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def cancel_abort(self) -> None:
        """Disarm the abort this call's failure armed, or would arm if it failed later."""
        with self._lock:
            self._cancelled = True
            if self._cancel is not None:
                self._cancel()

    def result(self) -> None:
        if self._thread.is_alive():
            raise WeightSyncError(f"vLLM's {self.what} did not return within the bound")
        if self.error is not None:
            raise WeightSyncError(
                f"vLLM's {self.what} failed: {type(self.error).__name__}: {self.error}"
            ) from self.error
