"""The worker side of backend ``"groupbridge"``: each vLLM worker joins the trainer's bridge as a receiver.

Lifecycle (vLLM calls these from the worker's own thread, between model steps):

- ``init_transfer_engine(info)``: join the group the trainer hosts (a new trainer session replaces the old
  one: its group is closed first). This worker's rank is ``1 + data_parallel_index * world_size +
  rank_in_world``, from vLLM's own parallel state, so every TP/PP rank of every DP replica is one receiver.
- ``update_weights({"version": v})``: run the handshake, where the sender's manifest is dry-run through the
  model's ``load_weights`` on meta tensors (see :mod:`._dryrun`) so a name or shape the model cannot load is
  refused before any bytes move, and every member raises the same error. Then receive:

  * atomic: into staging tensors; the model is not touched. The staged update is loaded in
    ``finish_weight_update``, which the trainer calls only once every worker acknowledged its bytes, so a
    trainer that dies midway, or a worker that fails, leaves every worker serving the old weights.
  * streaming: into ``load_weights`` inside vLLM's layerwise reload as buckets arrive; a failure midway
    finalizes the reload (the model never stays on the meta device) and raises :class:`TornUpdateError`.

- ``finish_weight_update()``: load the staged update (atomic) and record the version; vLLM then sets the
  served ``weight_version``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..errors import TornUpdateError
from ..stateless import StatelessGroup
from ..weights._bytes import BufferCache
from ..weights.manifest import Manifest
from ..weights.receiver import WeightReceiver
from ._dryrun import check_loadable

# under vLLM's logger tree, so these lines appear in vLLM's own log (a server's, a worker's) with its format
logger = logging.getLogger("vllm.groupbridge")


MAX_TIMEOUT_S = 3600.0
"""The longest an update (or a worker's join) may be allowed to take: vLLM's engine answers nothing else
while a worker waits, so an unbounded or absurd value would stop serving without an error."""
MAX_LIVENESS_S = 300.0


def check_seconds(**values: Any) -> None:
    """Each value is a number of seconds in (0, its maximum]: ``timeout*`` up to :data:`MAX_TIMEOUT_S`,
    ``liveness*`` up to :data:`MAX_LIVENESS_S`. Raises ValueError naming the field (inf, nan, bools and
    strings included), before anything is started or shut down."""
    for name, v in values.items():
        limit = MAX_LIVENESS_S if name.startswith("liveness") else MAX_TIMEOUT_S
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= limit:
            raise ValueError(f"{name}={v!r} must be a number of seconds in (0, {limit:g}]")


@dataclass
class WorkerInitInfo(WeightTransferInitInfo):
    """What the trainer tells every worker at ``init_weight_transfer_engine`` (plain JSON)."""

    host: str
    port: int
    world_size: int
    name: str = "vllm"
    generation: int = 0
    token: str | None = None
    atomic: bool = True
    timeout_s: float = 300.0
    liveness_s: float = 10.0
    sources: int = 1
    """Trainer ranks on the bridge (ranks 0 .. sources-1); the workers follow them."""

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"port={self.port!r} is not a TCP port")
        if not isinstance(self.sources, int) or self.sources < 1:
            raise ValueError(f"sources={self.sources!r} must be >= 1 (the trainer ranks on the bridge)")
        if not isinstance(self.world_size, int) or self.world_size < self.sources + 1:
            raise ValueError(f"world_size={self.world_size!r}: the trainer ranks and at least one worker")
        check_seconds(timeout_s=self.timeout_s, liveness_s=self.liveness_s)


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    """One update (plain JSON): the version the trainer sends; the manifest comes over the bridge."""

    version: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise ValueError(f"version must be an int, got {self.version!r}")


def _seconds(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f} s" for k, v in timings.items())


def worker_rank(parallel_config: Any, sources: int = 1) -> int:
    """This worker's rank on the bridge (the trainer ranks come first)."""
    from vllm.distributed.parallel_state import get_world_group

    index = parallel_config.data_parallel_index * parallel_config.world_size + get_world_group().rank_in_group
    return sources + int(index)


class WorkerEngine(WeightTransferEngine[WorkerInitInfo, UpdateInfo]):
    """vLLM worker engine of backend ``"groupbridge"`` (see the module docstring)."""

    init_info_cls = WorkerInitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: StatelessGroup | None = None
        self.receiver: WeightReceiver | None = None
        self.info: WorkerInitInfo | None = None
        self.version: int | None = None
        """The version this worker's model holds (None: the weights it was started with)."""
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self._received: int | None = None
        self._buffers = BufferCache()
        """The receive buffers (the kept copy of the weights among them), kept across bridge generations."""
        self._check_seconds = 0.0
        self.timings: dict[str, float] = {}
        """Seconds of the last update: ``handshake`` (with ``check``, the manifest's dry run), ``receive``
        (bytes in and staged, or streamed into the model), ``load`` (atomic: the staged update into vLLM)."""

    # ------------------------------------------------------------------ session

    def init_transfer_engine(self, init_info: WorkerInitInfo) -> None:
        self.shutdown()
        rank = worker_rank(self.parallel_config, init_info.sources)
        if rank >= init_info.world_size:
            raise ValueError(
                f"this vLLM worker is bridge rank {rank} but the trainer expects world_size="
                f"{init_info.world_size} (trainer + workers): give TrainerInitInfo(workers=) the number of "
                "vLLM workers (data parallel x tensor parallel x pipeline parallel)"
            )
        self.group = StatelessGroup.create(
            init_info.host,
            init_info.port,
            rank=rank,
            world_size=init_info.world_size,
            name=init_info.name,
            generation=init_info.generation,
            timeout=timedelta(seconds=init_info.timeout_s),
            liveness_timeout=timedelta(seconds=init_info.liveness_s),
            token=init_info.token,
        )
        # no src: the handshake finds the senders (rank 0, or every trainer rank sending its shards)
        self.receiver = WeightReceiver(self.group, device=self.device, buffers=self._buffers)
        self.info = init_info
        logger.info(
            "groupbridge: worker joined %s as rank %d of %d", init_info.host, rank, init_info.world_size
        )

    def shutdown(self) -> None:
        self._staged = None
        self._received = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ one update

    def start_weight_update(self) -> None:
        self._staged = None
        self._received = None

    def receive_weights(self, update_info: UpdateInfo) -> None:
        if self.receiver is None or self.info is None:
            raise RuntimeError("init_weight_transfer_engine has not been called for backend 'groupbridge'")
        timeout = timedelta(seconds=self.info.timeout_s)
        t0 = time.perf_counter()
        # Every update lands in the receiver's kept copy of the weights and yields whole tensors as views of
        # it, valid until the next update: nothing is staged per name, cloned or re-assembled, and vLLM's
        # layerwise reload may hold them until their layer is complete. A delta update still yields every
        # tensor (that reload needs whole layers); only the changes travel.
        update = self.receiver.receive(timeout=timeout, accept=self._accept, only_changed=False, keep=True)
        t1 = time.perf_counter()
        if update.version != update_info.version:
            logger.warning("groupbridge: update_info says version %d, the bridge %d", update_info.version,
                           update.version)  # fmt: skip
        if self.info.atomic and update.kept:
            self._staged = list(update)  # views of the kept copy: nothing to stage
        elif self.info.atomic:  # many senders: whole tensors assembled for this update, held until loaded
            self._staged = list(update)
        else:
            self._load(iter(update), update.version)  # views the loader may keep until its layer is whole
        self._received = update.version
        self.timings = {
            "handshake": t1 - t0,
            "receive": time.perf_counter() - t1,
            "check": self._check_seconds,
        }
        logger.info("groupbridge: version %d received: %s", update.version, _seconds(self.timings))

    def finish_weight_update(self) -> None:
        if (
            self._received is None
        ):  # a new trainer closing an update an earlier one left open: nothing to load
            logger.warning("groupbridge: finish_weight_update with no update received: nothing loaded")
            return
        if self._staged is not None:
            staged, self._staged = self._staged, None
            t0 = time.perf_counter()
            self._load(iter(staged), self._received)
            self.timings["load"] = time.perf_counter() - t0
            logger.info("groupbridge: version %d loaded: %s", self._received, _seconds(self.timings))
        self.version, self._received = self._received, None

    # ------------------------------------------------------------------ helpers

    def _accept(self, manifest: Manifest) -> str | None:
        t0 = time.perf_counter()
        try:
            return check_loadable(self.model, manifest)
        finally:
            self._check_seconds = time.perf_counter() - t0

    def _load(self, weights: Any, version: int) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        loaded: list[str] = []

        def counted() -> Any:
            for name, t in weights:
                loaded.append(name)
                yield name, t

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(counted())
        except BaseException as e:
            try:  # never leave the model on the meta device: the engine must keep serving
                finalize_layerwise_reload(self.model, self.model_config)
                refresh_cpu_kernels(self.model)
            except Exception:
                logger.exception("groupbridge: finalizing the interrupted reload failed")
            if isinstance(e, Exception):
                raise TornUpdateError(
                    f"loading version {version} into vLLM failed after {len(loaded)} tensors: "
                    f"{type(e).__name__}: {e}; the model now holds a mix of two versions (weight_version "
                    f"stays {self.version if self.version is not None else 'the initial one'}): send a full "
                    "update before trusting its output",
                    written=loaded,
                ) from e
            raise
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_cpu_kernels(self.model)


def refresh_cpu_kernels(model: torch.nn.Module) -> int:
    """Redo CPU kernel set-up that vLLM 0.32 skips after a reload; returns how many layers were redone.

    Both are vLLM bugs measured here (its own ``reload_weights`` has them too):

    - the unquantized MoE method runs its experts' ``process_weights_after_loading`` (on CPU: packing
      ``w13``/``w2`` into the grouped-GEMM layout) only when the kernel is first built, never on a weight
      update: after a reload the kernel reads unpacked weights (reloading the very weights a Qwen3-MoE was
      started with changed its greedy tokens);
    - a layer whose weight is tied to another's (an ``lm_head`` sharing the embedding) receives nothing in
      a reload, so its packed GEMM handle (``dispatch_cpu_unquantized_gemm``) is never rebuilt and keeps
      the old weights' values although the shared tensor holds the new ones.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    redone = 0
    owners: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if (
            experts is not None
            and type(experts).__name__ == "CPUUnquantizedExperts"
            and hasattr(layer, "w13_weight")
        ):
            experts.process_weights_after_loading(layer)
            redone += 1
        weight = layer._parameters.get("weight")
        if weight is not None and weight.numel() > 0 and getattr(layer, "quant_method", None) is not None:
            owners.setdefault(weight.data_ptr(), []).append(layer)
    for layers in owners.values():
        if len(layers) > 1:  # tied
            for layer in layers:
                layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
                redone += 1
    return redone
