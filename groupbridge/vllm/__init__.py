"""groupbridge as a vLLM weight-transfer backend (``pip install 'groupbridge[vllm]'``).

The ``vllm.general_plugins`` entry point registers backend ``"groupbridge"`` in every vLLM process, so::

    llm = vllm.LLM(model, weight_transfer_config={"backend": "groupbridge"})
    # or: vllm serve MODEL --weight-transfer-config '{"backend": "groupbridge"}'

and the trainer, on every rank::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory, ModuleSource
    from groupbridge.vllm import TrainerInitInfo, OfflineClient, shutdown
    engine = WeightTransferTrainerFactory.trainer_init(
        TrainerInitInfo(rank=rank, host="::1"), client=OfflineClient(llm), source=ModuleSource(model))
    engine.send_weights()  # every step; vLLM serves versions 1, 2, 3 ...
    engine.shutdown()  # the bridge (the workers leave it first)
    shutdown(llm)  # then vLLM's engine processes, now and in order

Several engines (replicas) updated as one, committed on every worker of every engine or on none::

    fleet = FleetClient([OfflineClient(llm_a), OfflineClient(llm_b)], workers=[1, 2])
    engine = WeightTransferTrainerFactory.trainer_init(
        TrainerInitInfo(rank=0, workers=fleet.total_workers), client=fleet, source=ModuleSource(model))

Every replica checked after the swap, and all rolled back when one disagrees (``gb.VerificationError``)::

    from groupbridge.engine import Probe, causal_logprobs
    TrainerInitInfo(rank=0, workers=fleet.total_workers,
                    verify=Probe(tokens, lambda version: causal_logprobs(model, tokens), atol=0.05))

Only a LoRA adapter (the source's module a PEFT model; the engine started with ``enable_lora=True``), served
under a fresh name per version::

    TrainerInitInfo(rank=0, adapter="policy", max_live_adapters=2)
    llm.generate(prompts, params, lora_request=adapter_request(llm, "policy"))   # policy@v3

Importing this package imports nothing of vLLM: its HTTP client (``_control``, which TRL's trainer uses)
runs where vLLM is not installed. The first name taken from it imports vLLM and registers the backend (a
trainer talking to ``vllm serve`` over HTTP never loads vLLM's plugins itself).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._client import OfflineClient, engine_calls
    from ._fleet import FleetClient
    from ._lora import adapter_request
    from ._plugin import BACKEND, register
    from ._serve import Server
    from ._stop import shutdown
    from ._trainer import TrainerEngine, TrainerInitInfo

_HOMES = {
    "BACKEND": "_plugin",
    "FleetClient": "_fleet",
    "OfflineClient": "_client",
    "Server": "_serve",
    "TrainerEngine": "_trainer",
    "TrainerInitInfo": "_trainer",
    "adapter_request": "_lora",
    "engine_calls": "_client",
    "register": "_plugin",
    "shutdown": "_stop",
}


def __getattr__(name: str) -> Any:
    """A public name, imported when first taken (with vLLM, the backend registered first)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(f"{__name__}._plugin").register()
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BACKEND",
    "FleetClient",
    "OfflineClient",
    "Server",
    "TrainerEngine",
    "TrainerInitInfo",
    "adapter_request",
    "engine_calls",
    "register",
    "shutdown",
]
