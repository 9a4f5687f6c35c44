"""The vLLM releases this package was read and tested against, the gate that holds the backend to them, and
the one accessor through which every private vLLM name is read.

A vLLM outside :data:`TESTED` may have moved any name groupbridge reads past vLLM's public API: the backend
then refuses to start, with one error naming both versions, unless the operator opts in (:data:`OPT_IN`).
With the opt-in, a private name that is gone still fails by name (:func:`private`), never by defaulting to
an empty value that would make, say, an adapter in use look unused.

:data:`PRIVATE` lists the private names the package reads as attributes of vLLM's classes and modules:
``tests/test_vllm_compat.py`` resolves each on the installed vLLM without starting an engine, so an upgrade
fails in one place, naming what moved. Not yet listed: the methods called on those objects (the reload's,
the processors' ``process_inputs``, ``add_request(queue=)``), and names reached only on a live model (each
module's docstring lists what it reads).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from ...errors import VLLMCompatError

__all__ = [
    "OPT_IN",
    "PRIVATE",
    "TESTED",
    "Private",
    "check_version",
    "installed",
    "module_of",
    "private",
    "supported",
]

logger = logging.getLogger("vllm.groupbridge")

TESTED = ((0, 32), (0, 33))
"""vLLM releases from the first (included) to the second (excluded), as (major, minor)."""

OPT_IN = "GROUPBRIDGE_VLLM_UNTESTED"
"""Set to ``1`` to start the backend on a vLLM outside :data:`TESTED` anyway (a moved private name then
fails where it is read, by name)."""


def installed() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm

    return str(vllm.__version__)


def _release(version: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _range() -> str:
    (a, b), (c, d) = TESTED
    return f">={a}.{b}, <{c}.{d}"


def supported(version: str) -> bool:
    """Whether ``version`` lies in :data:`TESTED` (pre-releases and local builds of a release count)."""
    release = _release(version)
    return release is not None and TESTED[0] <= release < TESTED[1]


def check_version(version: str | None = None) -> None:
    """Raise :class:`VLLMCompatError` unless ``version`` (default: the installed vLLM's) is tested, or the
    operator opted in (:data:`OPT_IN`, then a warning)."""
    version = installed() if version is None else version
    if supported(version):
        return
    if os.environ.get(OPT_IN) == "1":
        logger.warning(
            "groupbridge: running on vLLM %s, outside the releases it was tested against (%s), as %s=1 asks",
            version,
            _range(),
            OPT_IN,
        )
        return
    raise VLLMCompatError(
        f"groupbridge's vLLM backend was read and tested against vLLM {_range()}; this is vLLM {version}. "
        f"Install a vLLM in that range, or a groupbridge made for this one; {OPT_IN}=1 starts it anyway (a "
        "private vLLM name it reads that moved then fails by name, where it is read)"
    )


@dataclass(frozen=True)
class Private:
    """One private vLLM name groupbridge reads: where it lives, why groupbridge reads it, and which public
    vLLM API would let it go."""

    module: str
    owner: str
    """A class (or object) in ``module``, or ``""`` for the module itself."""
    name: str
    why: str
    instead: str


PRIVATE: tuple[Private, ...] = (
    Private(
        "vllm.v1.engine.core",
        "EngineCore",
        "model_executor",
        "the commit runs every worker's finish between two model steps",
        "an engine-core hook run between two steps for a weight-transfer backend",
    ),
    Private(
        "vllm.v1.engine.core",
        "EngineCore",
        "scheduler",
        "the adapter versions unfinished requests name, kept loadable across a commit",
        "a scheduler query for the adapters of unfinished requests",
    ),
    Private(
        "vllm.v1.engine.core",
        "EngineCore",
        "_weight_version",
        "the label set in the same step as the commit, so every token's version is exact",
        "finish_weight_update(weight_version) applied as one engine-core step",
    ),
    Private(
        "vllm.v1.engine.core",
        "EngineCore",
        "add_request",
        "requests refused one by one (a stopped engine, a token outside the vocabulary, an adapter "
        "gone) instead of failing inside the model step: wrapped on an attached engine core alone",
        "a request admission hook for plugins",
    ),
    Private(
        "vllm.v1.engine.core",
        "EngineCoreProc",
        "_send_error_outputs_to_client",
        "the requests in flight end as errors when the engine holds no one verified version",
        "an engine-core call that ends requests with an error",
    ),
    Private(
        "vllm.v1.engine.async_llm",
        "AsyncLLM",
        "finish_weight_update",
        "a server's labelled finish routed to the one-step commit",
        "finish_weight_update(weight_version) applied as one engine-core step",
    ),
    Private(
        "vllm.lora.worker_manager",
        "WorkerLoRAManager",
        "_load_adapter",
        "adapters served from memory instead of a checkpoint directory: wrapped on the loaders of an "
        "attached engine's workers alone",
        "a LoRA loader that takes tensors and a config",
    ),
    Private(
        "vllm.v1.worker.cpu_worker",
        "CPUWorker",
        "model_runner",
        "a worker's LoRA loader, reached when a trainer attaches the engine",
        "a weight-transfer engine given its worker's LoRA loader",
    ),
    Private(
        "vllm.v1.worker.lora_model_runner_mixin",
        "LoRAModelRunnerMixin",
        "lora_manager",
        "the same",
        "the same",
    ),
    Private(
        "vllm.lora.worker_manager",
        "WorkerLoRAManager",
        "_adapter_manager",
        "the model an adapter is built for",
        "the same loader",
    ),
    Private(
        "vllm.lora.worker_manager",
        "WorkerLoRAManager",
        "_lora_model_cls",
        "an adapter built as vLLM's loader builds one",
        "the same loader",
    ),
    Private(
        "vllm.lora.model_manager",
        "LoRAModelManager",
        "_active_adapters",
        "the adapters of the running batch, never dropped by an adapter commit",
        "a query for the adapters in use",
    ),
    Private(
        "vllm.model_executor.model_loader.reload",
        "",
        "initialize_layerwise_reload",
        "a streaming update loads through vLLM's own reload",
        "a public layerwise reload",
    ),
    Private(
        "vllm.model_executor.model_loader.reload",
        "",
        "finalize_layerwise_reload",
        "the same reload, ended whatever was loaded",
        "a public layerwise reload",
    ),
    Private(
        "vllm.model_executor.layers.rotary_embedding",
        "",
        "_ROPE_DICT",
        "the shadow's rotary caches built apart from the serving model's",
        "get_model building a second model without shared caches",
    ),
    Private(
        "vllm.distributed.parallel_state",
        "GroupCoordinator",
        "rank_in_group",
        "this worker's rank on the bridge",
        "the worker's rank in the weight-transfer init info",
    ),
    Private(
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        "input_processor",
        "a probe's request made as LLMEngine.add_request makes one",
        "LLMEngine.add_request(queue=...): a request whose outputs go to a queue of the caller's",
    ),
    Private(
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        "output_processor",
        "a probe's request read from a queue of its own, never from step(), so it takes no user's output",
        "the same",
    ),
    Private(
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        "engine_core",
        "a probe's request sent to the engine core",
        "the same",
    ),
    Private(
        "vllm.v1.engine.output_processor",
        "RequestOutputCollector",
        "get_nowait",
        "a probe's queue read without waiting",
        "the same",
    ),
    Private(
        "vllm.v1.engine.core_client",
        "MPClient",
        "resources",
        "an offline engine's engine-core processes, stopped and their shared memory removed",
        "LLM.shutdown(timeout=...) that waits for its processes and removes what they left",
    ),
    Private(
        "vllm.v1.engine.core_client",
        "BackgroundResources",
        "engine_manager",
        "the same",
        "the same",
    ),
    Private(
        "vllm.v1.engine.utils",
        "CoreEngineProcManager",
        "processes",
        "the same",
        "the same",
    ),
    Private(
        "vllm.distributed.weight_transfer.base",
        "ModuleSource",
        "_module",
        "a trainer rank sends the parameters it holds (DTensors as their local boxes), never gathered, "
        "and a LoRA adapter's tensors alone",
        "a public ModuleSource.module",
    ),
)
"""Every private vLLM name this package reads (see the module's docstring)."""


def private(obj: Any, name: str) -> Any:
    """``obj.name``, where ``name`` is a private vLLM name of :data:`PRIVATE`; raises
    :class:`VLLMCompatError` naming it and the installed vLLM when it is gone (never a default)."""
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise VLLMCompatError(
            f"vLLM {installed()}: {type(obj).__name__}.{name}, which groupbridge reads past vLLM's public "
            f"API, is gone (groupbridge was tested against vLLM {_range()}; see docs/vllm.md)"
        ) from e


def module_of(source: Any) -> Any:
    """The module a vLLM ``ModuleSource`` reads (None for another kind of source)."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    return private(source, "_module") if isinstance(source, ModuleSource) else None
