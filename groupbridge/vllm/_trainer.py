"""The trainer side of backend ``"groupbridge"``: vLLM's trainer engine over the engine layer's
:class:`groupbridge.engine.TrainerSession`.

``trainer_init`` and ``send_weights`` run on every trainer rank; rank 0 sends (and ranks 1 .. sources-1 with
it, their shards). Other ranks iterate the source (its gathers are collectives) and drop what it yields.
vLLM's weight-sync client is the session's :class:`EngineControl`: ``init_weight_transfer_engine`` to join,
``start_weight_update`` + ``update_weights`` to begin (each worker's handshake; an atomic update's bytes then
land while vLLM serves), ``finish_weight_update`` to commit (the load, and the served ``weight_version``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo as _VllmTrainerInitInfo
from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from ..engine import EngineControl, SessionState, TrainerConfig, TrainerSession
from ._compat import check_version, module_of
from ._control import VllmControl, out_of_vocabulary
from ._fleet import FleetClient
from ._lora import AdapterSpec, peft_adapter
from ._plugin import BACKEND

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass(kw_only=True)
class TrainerInitInfo(_VllmTrainerInitInfo, TrainerConfig):
    """How the trainer hosts the bridge to vLLM (``backend = "groupbridge"``): the fields of
    :class:`groupbridge.engine.TrainerConfig` (host, port, workers = vLLM worker processes, transport, atomic,
    token, timeout_s, liveness_s, checksum, bucket_bytes, first_version, delta, sources, listener) and vLLM's
    keyword-only ``rank``. A source's values may be DTensors or ``gb.Shard`` boxes when ``sources`` > 1.

    ``adapter``: send only the source's LoRA adapter (its module a PEFT model), served by vLLM under a fresh
    name per version, ``<adapter>@v<version>`` (see :func:`groupbridge.vllm.adapter_request`); the newest
    ``max_live_adapters`` versions stay served (requests begun on one go on with it). The engine must be
    started with ``enable_lora=True``, ``max_lora_rank`` at least the adapter's rank and ``max_cpu_loras``
    at least ``max_live_adapters``: otherwise the update is refused before any byte moves."""

    backend: ClassVar[str] = BACKEND

    name: str = "vllm"
    adapter: str | None = None
    max_live_adapters: int = 2

    def needs(self) -> tuple[str, ...]:
        return TrainerConfig.needs(self) + (("adapters",) if self.adapter is not None else ())

    def __post_init__(self) -> None:
        TrainerConfig.__post_init__(self)
        self.check_rank(self.rank)
        if self.adapter is not None:
            AdapterSpec(self.adapter, {"r": 1}, self.max_live_adapters)  # the name and bound, checked now
            if self.sources > 1:
                raise ValueError("adapter updates are sent by one trainer rank: sources must be 1")
            if self.keeps_previous and self.max_live_adapters < 2:
                raise ValueError(
                    "verify/rollback of adapter updates serve the previous version again: max_live_adapters "
                    "must be >= 2 (the previous one stays served)"
                )


class TrainerEngine(SessionState, TrainerWeightTransferEngine[TrainerInitInfo]):
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
        check_version()  # before anything reads vLLM past its public API
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info if info is not None else TrainerInitInfo(rank=0 if is_sender else 1)
        sends = self.info.rank < self.info.sources
        self._adapter: dict[str, Any] | None = None
        fleet = client if isinstance(client, FleetClient) else None
        control: EngineControl | None = None  # only rank 0 drives the engines
        if self.info.rank == 0:
            control = fleet.control(self._update_info) if fleet else VllmControl(client, self._update_info)
            control.check(self.info.needs())  # before anything joins (the session checks it again)
        if control is not None and self.info.verify is not None:  # every engine scores: these tokens too?
            problem = out_of_vocabulary(fleet.clients if fleet else [client], self.info.verify.tokens)
            if problem is not None:  # found now: after a commit, the engines would serve unverified weights
                raise ValueError(problem)
        self.session = TrainerSession(self.info, control, rank=self.info.rank) if sends else None

    @classmethod
    def trainer_init(
        cls,
        init_info: TrainerInitInfo,
        *,
        client: VLLMWeightSyncClient | None,
        source: WeightSource | None = None,
    ) -> Self:
        """``client`` drives the engines from rank 0; a sending rank > 0 (``sources > 1``) never calls it,
        so a rank in a process of its own, with no engine at hand, passes None."""
        if not isinstance(init_info, TrainerInitInfo):
            raise TypeError(
                f"init_info must be groupbridge.vllm.TrainerInitInfo, got {type(init_info).__name__}"
            )
        if source is None:
            raise ValueError("backend 'groupbridge' sends a WeightSource each step: pass source=")
        if client is None and init_info.rank == 0:
            raise ValueError("trainer rank 0 drives the engines: pass client= (e.g. an OfflineClient)")
        n = client.total_workers if isinstance(client, FleetClient) else init_info.workers
        if n != init_info.workers and init_info.is_sender:
            raise ValueError(
                f"workers={init_info.workers}, but the fleet's engines have {n} workers "
                f"({client.workers} per engine): pass TrainerInitInfo(workers={n})"  # type: ignore[union-attr]
            )
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.session is not None:
            engine.session.connect()
        return engine

    def connect(self) -> None:
        """Host a new bridge (the next generation) and have every vLLM worker join it."""
        assert self.session is not None
        self.session.connect()

    def shutdown(self) -> None:
        """Close the bridge; vLLM's workers are told to leave it first."""
        if self.session is not None:
            self.session.close()

    def send_weights(self, version: int | None = None) -> None:
        """Send the source's weights as the next version (or ``version``) and make vLLM serve them."""
        assert self.source is not None
        if self.info.adapter is not None:
            return self._send_adapter(version)
        meta = self.source.metadata()
        if self.session is None:
            if self.info.sources == 1:  # drive the source's gathers (collectives); rank 0 ships them
                for _ in self.source:
                    pass
            return  # with many sources no rank gathers: a rank that holds nothing to send has nothing to do
        named = self._held() if self.info.sources > 1 else iter(self.source)
        specs = {m.name: (tuple(m.shape), m.dtype) for m in meta}  # rank 0's manifest, before any pull
        self.session.send(named, version=version, specs=specs)

    def _send_adapter(self, version: int | None) -> None:
        """Only the adapter's tensors travel; its name and config go with the update's info."""
        assert self.source is not None and self.info.adapter is not None
        if self.session is None:
            return
        module = module_of(self.source)
        if not isinstance(module, torch.nn.Module):
            raise TypeError("adapter updates read the adapter from a ModuleSource over a PEFT model")
        tensors, config = peft_adapter(module)
        self._adapter = {"name": self.info.adapter, "config": config, "max_live": self.info.max_live_adapters}
        self.session.send(tensors, version=version)

    def _update_info(self) -> dict[str, Any]:
        return {"adapter": self._adapter} if self._adapter is not None else {}

    def _held(self) -> dict[str, Any]:
        """What this rank holds of the source, never gathered: a module's parameters (DTensors are sent as
        their local boxes), else the source's own pairs (``gb.Shard`` values are boxes)."""
        assert self.source is not None
        module = module_of(self.source)
        if isinstance(module, torch.nn.Module):
            return dict(module.named_parameters())
        return dict(iter(self.source))
