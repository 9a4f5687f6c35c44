"""The worker side of backend ``"groupbridge"``: vLLM's calls mapped onto the engine layer's
:class:`groupbridge.engine.WorkerSession`.

Lifecycle (vLLM calls these from the worker's own thread, between model steps):

- ``init_transfer_engine(info)``: join the group the trainer hosts (a new trainer session replaces the old
  one: its group is closed first). This worker's rank is ``sources + data_parallel_index * world_size +
  rank_in_world``, from vLLM's own parallel state, so every TP/PP rank of every DP replica is one receiver.
- ``update_weights({"version": v})``: run the handshake, where the sender's manifest is dry-run through the
  model's ``load_weights`` on meta tensors (see :mod:`._compat._dryrun`) so a name or shape the model
  cannot load is refused before any bytes move, and every member raises the same error. Then:

  * atomic: return; the bytes land on a thread of this worker in its kept buffer while the engine goes on
    serving. ``finish_weight_update``, which the trainer calls only once every worker acknowledged its
    bytes, waits for them and loads them: the only stop in serving. A trainer that dies midway, or a worker
    that fails, leaves every worker serving the old weights.
  * streaming: buckets go into ``load_weights`` inside vLLM's layerwise reload as they arrive (the engine
    serves nothing meanwhile); a failure midway finalizes the reload (the model never stays on the meta
    device) and raises :class:`TornUpdateError`.

- ``finish_weight_update()``: load the staged update (atomic) and record the version; vLLM then sets the
  served ``weight_version``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..engine import (
    Abandon,
    BridgeInfo,
    Commit,
    Receive,
    Rollback,
    Withhold,
    WorkerSession,
    handle,
    parse_update,
)
from ..errors import WeightSyncError
from ..weights.manifest import Manifest
from ..weights.shard import Box
from ._compat import (
    begin_reload,
    build_shadow,
    check_adapter,
    check_loadable,
    check_version,
    checkpoint_gone,
    cpu_kernel_handles,
    end_reload,
    exchange,
    loaded_adapters,
    on_cpu,
    rank_in_world,
    refresh_cpu_kernels,
    same_layout,
)
from ._lora import Adapters, AdapterSpec, adapter_id

ABANDONED = "groupbridge: the update was abandoned as the trainer asked"
"""What a worker raises to end an update on purpose (see :class:`UpdateInfo`)."""

# under vLLM's logger tree, so these lines appear in vLLM's own log (a server's, a worker's) with its format
logger = logging.getLogger("vllm.groupbridge")


@dataclass
class WorkerInitInfo(BridgeInfo, WeightTransferInitInfo):
    """What the trainer tells every worker at ``init_weight_transfer_engine`` (plain JSON)."""


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    """One update (plain JSON): the version the trainer sends; the manifest comes over the bridge.

    ``abandon``: drop the update in progress instead (a trainer recovering an engine another left
    mid-update). vLLM has no abort; the worker raises :data:`ABANDONED`, and a failed ``update_weights`` is
    what makes vLLM leave its update state, so a new ``start_weight_update`` is accepted.

    ``rollback``: nothing travels; ``version`` is the one the worker served before its last update (kept
    aside, see ``TrainerInitInfo(rollback=...)``), loaded again at ``finish_weight_update``.

    ``withhold``: nothing travels and nothing loads: ``version``, just committed, failed its probe with no
    earlier version to return to; the finish that follows labels the engine ``unverified`` (see
    ``_compat._core.UNVERIFIED``)."""

    version: int
    abandon: bool = False
    rollback: bool = False
    commit: bool = False
    """Nothing travels: the next ``finish_weight_update`` commits ``version`` only, and refuses (loading
    nothing) when another version is staged (a finish that arrives late, after a later update began)."""
    withhold: bool = False
    adapter: dict[str, Any] | None = None
    """A LoRA adapter's update: ``{"name", "config", "max_live"}`` (see :mod:`._lora`)."""
    bridge: str | None = None
    """The trainer's bridge (``BridgeInfo.bridge_id``): a worker on another refuses the update at once."""
    in_use: list[str] | None = None
    """With ``commit``: the adapter versions the engine core's unfinished requests name (kept loadable)."""

    def __post_init__(self) -> None:
        self.update = parse_update(vars(self))  # checked before anything acts on it
        """The update as a type of the engine layer's protocol (:mod:`groupbridge.engine`)."""
        if self.adapter is not None:
            AdapterSpec.parse(self.adapter)


def worker_rank(parallel_config: Any, sources: int = 1, rank_offset: int = 0) -> int:
    """This worker's rank on the bridge: the trainer ranks come first, then the workers of the engines
    before this one in a fleet (``rank_offset``)."""
    index = parallel_config.data_parallel_index * parallel_config.world_size + rank_in_world()
    return sources + rank_offset + int(index)


class VllmLoader:
    """A vLLM model as the worker session's loader: the dry run, then ``load_weights`` inside vLLM's
    layerwise reload (which may hold a view until its layer is whole), finalized whatever happened."""

    def __init__(self, engine: WeightTransferEngine[Any, Any]) -> None:
        self.engine = engine  # its model may be retargeted (a draft model's update): read at each call
        self._reloading = False
        self._handles: dict[int, int] | None = None
        self._reads: dict[str, Box | None] = {}
        self.adapter: tuple[AdapterSpec, int] | None = None
        """The update in flight is this adapter's version (set at each receive): the base is untouched."""
        self.requested: tuple[str, ...] | None = None
        """The adapter versions unfinished requests name, as the engine core said with the commit."""
        self.shadow: torch.nn.Module | None = None
        """The second copy of the serving model (see :meth:`keep_shadow`), or None."""
        self._serving: torch.nn.Module | None = None

    def keep_shadow(self) -> None:
        """Build the shadow (once per worker; it is kept across bridges). One that cannot be exchanged with
        the serving model module by module (LoRA wraps the serving model's layers) is not kept: updates then
        reload the serving copy, and the log says why. Runs in the join (the engine's RPC), once."""
        if self.shadow is not None:
            return
        gone = checkpoint_gone(self.engine.vllm_config)
        if gone is not None:
            logger.warning(
                "groupbridge: updates reload the serving model (no shadow swap): the engine's checkpoint %s "
                "is gone, and a shadow is loaded from it; the engine stops for each load "
                "(TrainerInitInfo(swap='reload') chooses this without the warning)",
                gone,
            )
            return
        t0 = time.perf_counter()
        try:
            shadow = build_shadow(self.engine.vllm_config)
        except Exception as e:
            raise WeightSyncError(
                "the shadow, a second processed copy of this worker's model (built once, so that updates "
                "load while the engine serves; see docs/memory.md for what it costs), could not be built: "
                f"{type(e).__name__}: {e}; TrainerInitInfo(swap='reload') updates the serving copy instead "
                "(the engine stops for each load, no second copy)"
            ) from e
        problem = same_layout(self.engine.model, shadow)
        if problem is not None:
            logger.warning("groupbridge: updates reload the serving model (no shadow swap): %s", problem)
            return
        self.shadow, self._serving = shadow, self.engine.model
        took = time.perf_counter() - t0
        logger.info("groupbridge: a shadow of the model was built in %.2f s: updates load into it while "
                    "the engine serves; the commit exchanges the copies", took)  # fmt: skip

    def swapping(self) -> bool:
        """The update in flight goes through the shadow: the serving model's weights (not an adapter's, nor
        a draft model's)."""
        return self.shadow is not None and self.adapter is None and self.engine.model is self._serving

    def prepare(self, weights: Any) -> None:
        """Load and process the update into the shadow, as the commit would into the serving model (vLLM's
        layerwise reload, then the CPU kernels it misses), while the engine serves."""
        assert self.shadow is not None
        handles = cpu_kernel_handles(self.shadow)
        begin_reload(self.shadow)
        try:
            self.shadow.load_weights(weights)  # type: ignore[operator]
        finally:  # the shadow never stays on the meta device, loaded or not
            end_reload(self.shadow, self.engine.model_config)
        refresh_cpu_kernels(self.shadow, handles)

    def swap(self) -> None:
        """The commit: the shadow's tensors into the serving model's modules, and the serving model's into
        the shadow's (which then holds the version served before)."""
        assert self.shadow is not None and self._serving is not None
        exchange(self._serving, self.shadow, in_place=not on_cpu())

    def check(self, manifest: Manifest) -> str | None:
        self._reads = {}
        if self.adapter is not None:
            shapes = [(e.name, tuple(e.shape)) for e in manifest.entries]
            return check_adapter(self.engine.model, self.engine.vllm_config, self.adapter[0], shapes)
        # through the shadow, this runs on the landing thread while the serving copy serves: never on it
        model = self.shadow if self.shadow is not None and self.swapping() else self.engine.model
        return check_loadable(model, manifest, reads=self._reads)

    def reads(self, manifest: Manifest) -> dict[str, Box | None]:
        """The slice of each tensor this worker's loaders keep (a tensor-parallel rank's), from the dry run
        of ``check``: later updates bring only those."""
        return self._reads

    def load(self, weights: Any) -> None:
        if self.adapter is not None:
            # what no commit may drop: the versions unfinished requests name (the engine core's list), or
            # else (a commit it did not list them for) every adapter vLLM holds loaded
            requested = self.requested
            in_use = loaded_adapters(self.engine.model) if requested is None else map(adapter_id, requested)
            self.engine.adapters.install(*self.adapter, weights, in_use)
            return

        self._handles = cpu_kernel_handles(self.engine.model)
        begin_reload(self.engine.model)
        self._reloading = True
        self.engine.model.load_weights(weights)

    def finish(self) -> None:
        handles, self._handles = self._handles, None
        if self._reloading:  # not when the reload could not even begin: the model was never touched
            self._reloading = False
            end_reload(self.engine.model, self.engine.model_config)
            refresh_cpu_kernels(self.engine.model, handles)


class WorkerEngine(WeightTransferEngine[WorkerInitInfo, UpdateInfo]):
    """vLLM worker engine of backend ``"groupbridge"`` (see the module docstring)."""

    init_info_cls = WorkerInitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_version()  # before anything reads vLLM past its public API
        super().__init__(*args, **kwargs)
        self.adapters = Adapters()
        """The adapter versions this worker received over the bridge (its engine's alone), which its LoRA
        loader serves from memory once a trainer attached the engine (``_compat._core``)."""
        self.loader = VllmLoader(self)
        self._rolled_back: int | None = None
        self._withheld = False
        """The next finish loads nothing: the version served failed its probe (``UpdateInfo.withhold``)."""
        self._commits: int | None = None
        """The version the next finish must commit (``UpdateInfo.commit``), when the trainer said."""
        self.session = WorkerSession(
            self.loader, device=self.device, log=logger, swaps=self.loader, reads=self.loader
        )

    @property
    def version(self) -> int | None:
        """The version this worker's model holds (None: the weights it was started with)."""
        return self.session.version

    @property
    def timings(self) -> dict[str, float]:
        return self.session.timings

    def init_transfer_engine(self, init_info: WorkerInitInfo) -> None:
        self.session.close()
        if init_info.swap == "shadow":
            self.loader.keep_shadow()
        self.session.join(
            init_info, worker_rank(self.parallel_config, init_info.sources, init_info.rank_offset)
        )

    def shutdown(self) -> None:
        self.session.close()

    def start_weight_update(self) -> None:
        self.begin_update()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        handle(self, update_info.update)

    # ------------------------------------------------------------------ the engine layer's UpdateWorker

    def begin_update(self) -> None:
        self._rolled_back = None
        self._withheld = False
        self._commits = None
        self.loader.requested = None
        self.session.begin()

    def expect_commit(self, update: Commit) -> None:
        self._commits = update.version
        self.loader.requested = update.in_use

    def withhold(self, update: Withhold) -> None:
        if update.version != self.version:
            raise ValueError(
                f"groupbridge: asked to withhold version {update.version}, but version "
                f"{self.version} is served: nothing changed"
            )
        self._withheld = True

    def abandon(self, update: Abandon) -> None:
        self.session.abandon()
        raise RuntimeError(f"{ABANDONED}: nothing loaded, version {self.version} still served")

    def rollback(self, update: Rollback) -> None:
        if update.adapter is not None:
            # an adapter's versions are served under names of their own: the newer is withdrawn, nothing loads
            self.adapters.withdraw_newer(AdapterSpec.parse(update.adapter).name, update.version)
            self._rolled_back = update.version
            return
        self.session.stage_rollback(update.version)

    def receive(self, update: Receive) -> None:
        adapter = update.adapter
        self.loader.adapter = (AdapterSpec.parse(adapter), update.version) if adapter is not None else None
        line = self.loader.adapter[0].name if self.loader.adapter is not None else ""
        self.session.receive(update.version, line=line, bridge=update.bridge)

    def finish_update(self) -> None:
        self.finish_weight_update()

    def finish_weight_update(self) -> None:
        """Load the staged update. Raises (vLLM then keeps the version it reports) when there is nothing to
        load (see :meth:`groupbridge.engine.WorkerSession.commit`), or when the finish was for another
        version than the one staged (``UpdateInfo.commit``): nothing is loaded, and that update stays
        staged for its own finish."""
        commits, self._commits = self._commits, None
        if self._withheld:  # the engine core labels it unverified; the model keeps what it holds
            self._withheld = False
            return
        staged = self._rolled_back if self._rolled_back is not None else self.session.staged
        if commits is not None and commits != staged:
            raise RuntimeError(
                f"groupbridge: asked to commit version {commits}, but version {staged} is staged (a finish "
                f"that arrived after a later update began): nothing loaded, version {self.version} served"
            )
        if self._rolled_back is not None:
            self.session.version, self._rolled_back = self._rolled_back, None
            return
        self.session.commit()
