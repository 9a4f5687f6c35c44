"""groupbridge as a verl checkpoint engine: backend ``"groupbridge"``, loaded without forking verl::

    actor_rollout_ref.rollout.checkpoint_engine.backend=groupbridge
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=groupbridge.verl
    # optional: actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.groupbridge.sources=all

verl's ``CheckpointEngineManager`` drives every update the same way, whatever the backend: ``prepare`` on
every actor and rollout worker, ``build_topology`` on the driver, ``init_process_group`` on every worker,
``send_weights`` (every actor rank, with its engine's per-tensor generator) beside ``receive_weights`` (every
rollout worker, into its server adapter), then ``finalize``. Here that is one groupbridge bridge per update:
the master actor binds its socket in ``prepare`` (before the port is told to anyone), the others join it in
``init_process_group``, and the weights move with a manifest checked before any byte does, checksums (a
MAC with ``token``), bounded waits, one commit for every receiver, and shared memory on one host.

``sources``: ``1`` (default): actor rank 0 sends the whole tensors its generator yields (verl's FSDP and
Megatron engines gather each one on every rank: the other ranks walk their generators, dropping what they
yield, so the gathers stay matched). ``"all"``: every actor rank sends what its generator yields, and the
receivers assemble whole tensors: DTensors as their local boxes, ``gb.Shard`` values as theirs (rank-local
tensors, never gathered); whole tensors every rank holds are split among the ranks.

It runs on the engine layer's sessions, as the vLLM backend does: each sending actor rank a
:class:`~groupbridge.engine.TrainerSession` per update (verl makes a new bridge each time), whose engine
control does nothing (verl's manager calls the rollout workers itself); each rollout worker one
:class:`~groupbridge.engine.WorkerSession` for its life (its kept buffer reused by every update), whose loader
hands the landed tensors to verl's server adapter.

``delta`` (``true`` or ``"always"``, as ``WeightSender(delta=)``): only what changed since the last update
travels. The bridge is per update, the bases are not: each sending actor rank keeps its own for the engine's
life (a :class:`~groupbridge.weights.DeltaMemory`: one copy of the bytes it sends), and each rollout worker's
kept buffer is its base. A rollout worker that lost it (restarted, a new replica) gets a full update (with
one sending rank: the whole update is full for every worker, since one stream carries it; with
``sources="all"``: that worker's pairs only); the next is a delta again.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .engine import BridgeInfo, Described, EngineControl, TrainerConfig, TrainerSession, WorkerSession
from .engine._calls import usable
from .errors import WeightSyncError
from .net import Listener, listen
from .weights import DeltaMemory, SyncStats
from .weights.manifest import Manifest

__all__ = ["GroupBridgeCheckpointEngine"]

BACKEND = "groupbridge"
_TAG = "groupbridge"
_END = object()


class _VerlDrives(EngineControl):
    """The trainer session's engine control under verl: nothing to call, verl's manager drives the rollout
    workers itself (``init_process_group``, ``receive_weights``, ``finalize`` on each)."""

    def join(self, info: dict[str, Any]) -> None:
        pass

    def begin(self, version: int) -> None:
        pass

    def commit(self, version: int) -> None:
        pass

    def leave(self) -> None:
        pass


class _Handoff:
    """A rollout worker's loader: the landed tensors (views of the kept buffer, valid until the next update)
    go to verl's server adapter through ``receive_weights``, which it consumes."""

    def __init__(self) -> None:
        self.pairs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def check(self, manifest: Manifest) -> str | None:
        return None  # verl's server adapters load whatever names they are given

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        for pair in weights:
            self.pairs.put(pair)

    def finish(self) -> None:
        pass


@CheckpointEngineRegistry.register(BACKEND)
class GroupBridgeCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """verl checkpoint engine ``"groupbridge"`` (see the module docstring).

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes``, in bytes: the bucket size on the wire.
        is_master: verl sets it on actor rank 0: the rank that hosts the bridge.
        host: the address the master binds and every worker dials (IPv4, IPv6, a host name).
        sources: ``1`` or ``"all"`` (see the module docstring).
        transport: ``"auto"`` or one of groupbridge's transports.
        token: a shared secret: members prove it at join and every bucket carries a MAC.
        timeout: seconds that bound joining and each whole update (verl's configuration key).
        liveness: seconds after which a silent peer counts as gone (verl's configuration key).
        checksum: a checksum of every bucket (XXH3-64 on the host, ``mix64`` on a device), verified before an
            update is committed.
        device: where a rollout worker lands the bytes (its server adapter's device; default CPU).
        atomic: a rollout worker yields nothing until every byte landed and was verified, so a sender
            failing midway leaves its engine untouched; False yields
            each tensor as it lands (the server adapter loads while bytes move; a failure midway is torn).
        delta: ``True`` sends only what changed since the last update where diffing pays (a slow link);
            ``"always"`` on every update after the first; ``False`` (default) full updates. Costs one copy of
            the bytes each sending rank sends, kept for the engine's life (see the module docstring).
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        *,
        host: str = "127.0.0.1",
        sources: int | str = 1,
        transport: str = "auto",
        token: str | None = None,
        timeout: float = 300.0,
        liveness: float = 10.0,
        checksum: bool = True,
        device: str = "cpu",
        atomic: bool = True,
        delta: bool | str = False,
    ) -> None:
        if sources not in (1, "all"):
            raise ValueError(f"sources={sources!r} must be 1 or 'all'")
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of bytes")
        # checked now, as every update's would be (a bad value fails at construction, not at step 1)
        TrainerConfig(host=host, transport=transport, token=token, timeout_s=timeout, liveness_s=liveness,
                      delta=delta)  # fmt: skip
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.host = host
        self.sources = sources
        self.transport = transport
        self.token = token
        self.timeout = timeout
        self.liveness = liveness
        self.checksum = checksum
        self.device = torch.device(device)
        self.atomic = atomic
        self.delta = delta
        self.memory = DeltaMemory()
        """A sending actor rank's delta bases, kept across updates (each update's session is new)."""
        self.rank: int | None = None
        self.session: TrainerSession | None = None
        """A sending actor rank's session for this update (a new one per update: verl makes a new bridge)."""
        self._handoff = _Handoff()
        self.worker = WorkerSession(self._handoff, device=self.device)
        """A rollout worker's session, for its life: its kept buffer is reused by every update."""
        self._joined = False
        self.version = 0
        """The last version sent or received (verl's ``global_steps`` when it gives them)."""
        self.last_seconds = 0.0
        self._listener: Listener | None = None
        self._described = Described()

    # ------------------------------------------------------------------ topology

    def prepare(self) -> dict[str, Any]:
        """The master binds the bridge's socket now, before its address is published in the metadata."""
        meta: dict[str, Any] = {_TAG: True, "master": self.is_master, "sources": self.sources}
        if self.is_master:
            if self._listener is not None:
                self._listener.close()
            self._listener = listen(self.host, 0)
            meta.update(host=self._listener.address.host, port=self._listener.port)
        return meta

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Bridge ranks: the master 0, then (``sources="all"``) the other actor ranks, then the rollout
        workers; with one source the other actor ranks get -1 (they walk their generators, nothing more)."""
        actors, n = metadata[:actor_wg_world_size], actor_wg_world_size + rollout_world_size
        if len(metadata) != n or not all(isinstance(m, dict) and m.get(_TAG) for m in metadata):
            raise ValueError(f"metadata of {n} groupbridge workers expected, got {metadata!r}")
        masters = [i for i, m in enumerate(actors) if m["master"]]
        if len(masters) != 1:
            raise ValueError(f"exactly one actor rank must be the master (is_master), got {masters}")
        settings = {m["sources"] for m in actors}
        if len(settings) != 1:
            raise ValueError(f"the actor ranks disagree on sources: {sorted(map(str, settings))}")
        every = settings.pop() == "all"
        master = masters[0]
        senders = actor_wg_world_size if every else 1
        order = [master] + [i for i in range(actor_wg_world_size) if i != master]
        actor_ranks = [-1] * actor_wg_world_size
        for bridge_rank, i in enumerate(order[:senders]):
            actor_ranks[i] = bridge_rank
        world = senders + rollout_world_size
        where = {"host": actors[master]["host"], "port": actors[master]["port"], "world_size": world,
                 "sources": senders}  # fmt: skip

        def spread(ranks: list[int]) -> dict[str, list[Any]]:
            return {"rank": ranks, **{k: [v] * len(ranks) for k, v in where.items()}}

        return spread(actor_ranks), spread([senders + j for j in range(rollout_world_size)])

    def init_process_group(self, rank: int, world_size: int, host: str, port: int, sources: int) -> None:
        """Join this update's bridge (the master hosts it on the socket bound in ``prepare``)."""
        self._leave()
        self.rank = rank
        if rank < 0:
            return
        if rank >= sources:
            # a trainer session's first bridge is its generation 1 (verl makes a session per update)
            info = BridgeInfo(
                host=host, port=port, world_size=world_size, name="verl", generation=1, token=self.token,
                atomic=self.atomic, timeout_s=self.timeout, liveness_s=self.liveness, sources=sources,
            )  # fmt: skip
            self.worker.join(info, rank)
            self._joined = True
            return
        lis, self._listener = self._listener, None
        config = TrainerConfig(
            host=host if rank > 0 else self.host, port=port if rank > 0 else 0,
            workers=world_size - sources, transport=self.transport if sources == 1 else "auto",
            token=self.token, timeout_s=self.timeout, liveness_s=self.liveness, checksum=self.checksum,
            bucket_bytes=self.bucket_size, name="verl", sources=sources, listener=lis if rank == 0 else None,
            delta=self.delta,
        )  # fmt: skip
        self.session = TrainerSession(config, _VerlDrives() if rank == 0 else None, rank=rank,
                                      memory=self.memory)  # fmt: skip
        try:
            self.session.connect()
        except BaseException:
            if lis is not None:
                lis.close()
            self.session = None
            raise

    def finalize(self) -> None:
        """Leave this update's bridge (a rollout worker's buffers stay for the next update)."""
        self._leave()
        if self._listener is not None:  # prepared, never joined
            self._listener.close()
            self._listener = None

    def _leave(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        if self._joined:
            self.worker.close()
            self._joined = False

    # ------------------------------------------------------------------ one update

    def _next(self, global_steps: int | None) -> int:
        self.version = global_steps if global_steps is not None else self.version + 1
        return self.version

    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> dict[str, float]:
        """Send (a rank with bridge rank < sources) or walk (the others) this rank's generator; returns
        verl metrics."""
        version = self._next(global_steps)
        session = self.session
        if session is None:
            await asyncio.to_thread(_walk, weights)
            return {}
        if session.group is None or not usable(session.group):  # no rollout worker would join a new one
            raise WeightSyncError(
                f"actor rank {self.rank}: this update's bridge is closed or broke (verl's next update makes "
                "a new one)"
            )
        t0 = time.perf_counter()
        if self.sources == "all":
            await asyncio.to_thread(session.send, dict(weights), version=version)
        else:
            await asyncio.to_thread(self._send_streamed, session, weights, version)
        self.last_seconds = time.perf_counter() - t0
        return _metrics(self.last_seconds, session.last_stats)

    def _send_streamed(
        self, session: TrainerSession, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        pairs, specs = self._described.pairs(weights)
        try:
            session.send(pairs, version=version, specs=specs)
        except Exception:
            self._described.forget()  # a changed model is described again
            raise
        self._described.sent(pairs)

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor): views of this worker's kept buffer, valid until the next update (verl's
        server adapters copy them into the engine). ``atomic``: only once the whole update landed here and
        was verified; else as each tensor lands."""
        if not self._joined:
            raise RuntimeError("init_process_group has not made this worker a receiver")
        version = self._next(global_steps)
        worker, handoff = self.worker, self._handoff
        passed = worker.passed()
        if global_steps is not None and passed is not None and version <= passed:
            # verl's driver owns this worker and goes back on purpose: a validation sends its step again, a
            # resumed trainer an older one (a second trainer cannot reach it: it joins verl's bridges only)
            why = "verl sends its step again" if version == passed else "verl resumed from an older step"
            worker.reset_versions("", f"{why}: {passed} -> {version}")
        # this update's own queue: a waiter left from an earlier update takes nothing of it
        handoff.pairs = queue.SimpleQueue()

        def run() -> None:
            try:
                worker.begin()
                worker.receive(version)  # streaming: the loader takes each tensor here, as it lands
                worker.commit()  # atomic: the wait for every byte, then the loader takes them all
            finally:
                handoff.pairs.put(_END)

        done: asyncio.Future[None] = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            bound = (
                self.timeout + self.liveness + 5
            )  # past the update's own bounds: fires only if they did not
            while (item := await asyncio.to_thread(_take, handoff.pairs, bound)) is not _END:
                yield item
            await done  # raises what stopped the update
        finally:
            # the consumer stopped early: an update still running after a moment's grace (it may be
            # finishing: its last tensor was handed over) is ended by leaving the bridge
            await asyncio.wait({done}, timeout=self.liveness)
            if not done.done():
                await asyncio.to_thread(self._leave)
                with contextlib.suppress(BaseException):
                    await done
            while not handoff.pairs.empty():
                handoff.pairs.get_nowait()


def _metrics(seconds: float, stats: SyncStats | None) -> dict[str, float]:
    """verl metrics of one update on this rank: ``bytes`` (what it sent, as whole bytes), ``wire_bytes``
    (what travelled: less than ``bytes`` for a delta), ``changed_fraction`` (of the values compared; 1.0
    for a full update), ``delta`` (1.0 when this rank sent a delta), and ``base_bytes`` (what it keeps for
    deltas)."""
    out = {"groupbridge/seconds": seconds}
    if stats is None:
        return out
    out.update({
        "groupbridge/gb_per_s": stats.gb_per_s,
        "groupbridge/bytes": float(stats.bytes),
        "groupbridge/wire_bytes": float(stats.wire_bytes),
        "groupbridge/changed_fraction": stats.changed_fraction,
        "groupbridge/delta": float(stats.delta),
        "groupbridge/base_bytes": float(stats.base_bytes),
    })  # fmt: skip
    return out


def _take(pairs: queue.SimpleQueue[Any], seconds: float) -> Any:
    """The next landed pair (or the end), waiting at most ``seconds``."""
    try:
        return pairs.get(timeout=seconds)
    except queue.Empty:
        raise TimeoutError(f"no tensor of the update landed within {seconds:g} s") from None


def _walk(weights: Iterable[Any]) -> None:
    for _ in weights:  # each item may be a collective (a gather): every rank walks the generator
        pass
