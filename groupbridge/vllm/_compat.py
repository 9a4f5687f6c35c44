"""Where groupbridge reaches into vLLM past its public API, kept in one place: read from vLLM 0.32.

**The shadow** (:func:`build_shadow`, :func:`exchange`): a second copy of the model, loaded and processed
while the serving copy serves, whose tensors are exchanged into the serving copy's modules at the commit.

**The commit and its version label in one engine-core call.** vLLM's ``finish_weight_update(weight_version)``
is two calls into the engine core: a ``collective_rpc`` that has the workers load the update, then
``set_weight_version``. The engine core runs model steps between the two, so the tokens sampled there carry
the old version's label although the new weights made them: ``CompletionOutput.weight_versions`` (the spans
of output tokens per version) puts a request's boundary late. :data:`COMMIT` is one engine-core utility that
does both, between the same two model steps: the spans are then exact (with synchronous scheduling; see
``docs/vllm.md`` for what asynchronous scheduling does to the boundary). It is added to the engine core in
each engine-core process when the plugin loads there, and the two clients route to it:
:func:`commit_offline` for an offline ``LLM`` (the trainer's :class:`~groupbridge.vllm.OfflineClient`) and
``AsyncLLM.finish_weight_update`` for ``vllm serve``, wrapped for engines whose weight-transfer backend is
``groupbridge`` only (others keep vLLM's behaviour).

**Adapters from memory** (:func:`serve_adapters`): vLLM's worker LoRA loader asks an engine's
:class:`~groupbridge.vllm._lora.Adapters` about each load, for that engine's workers alone.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any

import torch

from . import _lora
from ._plugin import BACKEND

__all__ = [
    "COMMIT",
    "PAUSED",
    "TORN",
    "VLLM_READ",
    "build_shadow",
    "commit_offline",
    "exchange",
    "install",
    "loaded_adapters",
    "same_layout",
    "serve_adapters",
]

VLLM_READ = "0.32"
"""The vLLM release the private names below were read from."""

COMMIT = "groupbridge_commit"
"""The engine-core utility: the workers' ``finish_weight_update``, then the label, in one call."""


def _commit(core: Any, weight_version: str) -> float:
    """On the engine core (its ``EngineCore``), between two model steps: every worker commits version
    ``weight_version`` (told first, so that a worker holding another version staged, a finish that arrived
    late, refuses and loads nothing), then the outputs of every later step carry ``weight_version``. A
    commit that fails raises before the label moves: the engine keeps reporting the version it served.

    Returns how long the engine core stopped for it (the seconds between its two model steps), also logged
    (:data:`PAUSED`): the pause the commit costs the engine, apart from the HTTP call and the wait for the
    model step under way that a caller's own clock adds."""
    t0 = time.perf_counter()
    executor = core.model_executor
    lora = getattr(core.vllm_config, "lora_config", None) is not None
    if weight_version.isdigit() and len(weight_version) < 19:
        told: dict[str, Any] = {"version": int(weight_version), "commit": True}
        if lora:  # what no adapter commit may drop: every unfinished request's, not the running batch's alone
            told["in_use"] = _lora.requested(core.scheduler.requests.values())
        executor.collective_rpc("update_weights", kwargs={"update_info": told})
    try:
        executor.collective_rpc("finish_weight_update")
    except BaseException:
        if any(h == TORN for h in _holding(executor)):  # never the label of a version it does not serve
            core._weight_version = TORN
        raise
    core._weight_version = weight_version
    if lora:  # what a request may name until the next commit: what every worker can load
        names = [set(n) for n in executor.collective_rpc(_lora.registered)]
        _ADMITS[core] = frozenset(set.intersection(*names)) if names else frozenset()
    paused = time.perf_counter() - t0
    _lora.logger.info("%s %s: %.2f ms", PAUSED, weight_version, paused * 1e3)
    return paused


PAUSED = "groupbridge: the engine paused for the commit of version"
"""How the engine core's log states each commit's pause (``<PAUSED> <version>: <ms> ms``)."""


TORN = "torn"
"""The version an engine reports while a worker's model holds a mix of versions (a load into it failed
midway): until a commit succeeds, which loads every tensor."""


def _holds(worker: Any) -> str:
    """On a worker (``collective_rpc``): what its model holds, the version or :data:`TORN`."""
    engine = getattr(worker, "weight_transfer_engine", None)
    session = getattr(engine, "session", None)
    if session is None:
        return "unknown"
    return TORN if session.torn else str(session.version)


def _holding(executor: Any) -> list[str]:
    """What each worker's model holds, asked after a commit failed (``unknown`` where it cannot say)."""
    try:
        return [str(h) for h in executor.collective_rpc(_holds, timeout=30)]
    except Exception as e:
        _lora.logger.warning("groupbridge: could not ask the workers what they hold: %s", e)
        return ["unknown"]


_ADMITS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
"""Per engine core (of this process: one), the adapter versions every worker can load after its last
commit; kept here, not written into vLLM's object."""


def _admit(core: Any, request: Any) -> str | None:
    """Why ``request`` must not reach a model step, or None: a prompt token outside the model's vocabulary
    where vLLM checks none (an engine without a tokenizer: its embedding would fail), or an adapter version
    of the registry that no longer is (or never was) loadable (its load would fail). Either fails inside
    the step, where an error ends the engine; refused here, one request fails."""
    if not _ours(core):
        return None
    model_config = core.vllm_config.model_config
    tokens = getattr(request, "prompt_token_ids", None)
    if tokens and getattr(model_config, "skip_tokenizer_init", False):
        vocab = int(model_config.get_vocab_size())
        bad = next((t for t in (min(tokens), max(tokens)) if not 0 <= t < vocab), None)
        if bad is not None:
            return f"prompt token {bad} lies outside the model's vocabulary of {vocab}"
    lora = getattr(request, "lora_request", None)
    path = str(getattr(lora, "lora_path", "") or "")
    if lora is None or not path.startswith(_lora.SCHEME):
        return None
    if lora.lora_name in _ADMITS.get(core, frozenset()):
        return None
    return (
        f"adapter {lora.lora_name!r} is not served by this engine: it was never received, or is older than "
        "the newest max_live_adapters and no request used it at the last commit"
    )


def commit_offline(llm: Any, weight_version: str) -> float:
    """An offline ``LLM``'s commit of its staged update, labelled ``weight_version``: one engine-core call.
    Returns the engine's pause for it (see :func:`_commit`)."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):  # the engine core in its own process (vLLM's default)
        return float(client.call_utility(COMMIT, weight_version))
    return _commit(client.engine_core, weight_version)  # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)


def _ours(engine: Any) -> bool:
    config = getattr(getattr(engine, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == BACKEND


def install() -> None:
    """Add :data:`COMMIT` to the engine core and route a ``vllm serve``'s labelled finish through it (in this
    process; idempotent: the plugin loads more than once per process)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, COMMIT):
        setattr(EngineCore, COMMIT, _commit)
        add = EngineCore.add_request

        @functools.wraps(add)
        def add_request(self: Any, request: Any, request_wave: int = 0) -> None:
            problem = _admit(self, request)
            if problem is None:
                add(self, request, request_wave)
                return None
            _lora.logger.warning("groupbridge: request %s refused: %s", request.request_id, problem)
            send = getattr(self, "_send_error_outputs_to_client", None)
            if send is None:  # the engine core in the caller's process: the caller's add raises
                raise ValueError(problem)
            send([request.request_id], request.client_index)  # that request alone ends, as an error
            return None

        EngineCore.add_request = add_request
    original = AsyncLLM.finish_weight_update
    if getattr(original, "_groupbridge", False):
        return

    @functools.wraps(original)
    async def finish_weight_update(self: Any, weight_version: str | None = None) -> None:
        if weight_version is None or not _ours(self):
            await original(self, weight_version)
        else:
            await self.engine_core.call_utility_async(COMMIT, weight_version)

    finish_weight_update._groupbridge = True  # type: ignore[attr-defined]
    AsyncLLM.finish_weight_update = finish_weight_update


_SERVED: weakref.WeakKeyDictionary[Any, _lora.Adapters] = weakref.WeakKeyDictionary()
"""Per LoRA model manager (one per worker of an engine that takes adapters over the bridge), the adapters
its loader serves: kept here, not written into vLLM's objects."""


def serve_adapters(model: torch.nn.Module, adapters: _lora.Adapters) -> None:
    """Have the LoRA loader of ``model``'s worker ask ``adapters`` about every load (see
    :meth:`~groupbridge.vllm._lora.Adapters.check_load`). vLLM's loader method is wrapped once per process;
    a worker whose model is not registered here (another backend's engine) loads as vLLM does."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    manager = getattr(model, "lora_manager", None)
    if manager is None:  # no LoRA layers: the handshake refuses adapters (``_lora.check_adapter``)
        return
    _SERVED[manager] = adapters
    original = WorkerLoRAManager._load_adapter
    if getattr(original, "_groupbridge", False):
        return

    @functools.wraps(original)
    def load(self: Any, lora_request: Any) -> Any:
        served = _SERVED.get(self._adapter_manager)
        if served is None:
            return original(self, lora_request)
        full = served.check_load(str(lora_request.lora_path), str(lora_request.lora_name))
        if full is None:
            return original(self, lora_request)
        tensors, config = served.filed(full)
        return _lora_model(self, lora_request, tensors, config)

    load._groupbridge = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = load


def _lora_model(
    manager: Any, lora_request: Any, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> Any:
    """vLLM's LoRA model of an adapter's tensors, built as its loader builds one from a checkpoint."""
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(dict(config, vllm_max_position_embeddings=manager.max_position_embeddings))
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # copies: vLLM's LoRA model may work on the tensors it is given in place (on CPU it keeps them, and
    # folds the scaling into lora_B), and this adapter is loaded again after every weight update
    return manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id, tensors={n: t.clone() for n, t in tensors.items()},
        peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )  # fmt: skip


def loaded_adapters(model: torch.nn.Module) -> set[int]:
    """The ids of the adapters ``model``'s LoRA manager holds loaded (those of the running batch)."""
    return set(getattr(getattr(model, "lora_manager", None), "_active_adapters", {}) or {})


def build_shadow(vllm_config: Any) -> torch.nn.Module:
    """A second copy of the model, built and loaded by vLLM's own loader from the model's checkpoint, alone:
    under a copy of the config with a forward-context registry of its own (the serving copy's attention
    layers are registered under the same names: "Duplicate layer name"), and its own rotary embeddings
    (vLLM caches them process-wide; a shadow sharing the serving copy's, once reloaded, broke the serving
    copy). It never runs a forward: its tensors are exchanged into the serving copy's modules."""
    import copy

    import vllm.model_executor.layers.rotary_embedding as rope
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    config = copy.copy(vllm_config)
    config.compilation_config = copy.copy(vllm_config.compilation_config)
    config.compilation_config.static_forward_context = {}
    cached = dict(rope._ROPE_DICT)
    rope._ROPE_DICT.clear()
    try:
        with set_current_vllm_config(config):
            model: torch.nn.Module = get_model(vllm_config=config)
            return model
    finally:
        rope._ROPE_DICT.clear()
        rope._ROPE_DICT.update(cached)


KERNEL_HANDLES = ("cpu_linear",)
"""Attributes (outside ``_parameters`` and ``_buffers``) where vLLM keeps a layer's processed weights: on
CPU the packed GEMM handle of an unquantized linear layer."""


def exchange(serving: torch.nn.Module, shadow: torch.nn.Module, *, in_place: bool = False) -> None:
    """Exchange the two copies' tensors, module by module: parameters, buffers and kernel handles. The
    serving copy's modules stay the objects vLLM registered (attention layers, experts found by name);
    only what they hold changes.

    ``in_place`` (off the CPU): the tensors' contents are exchanged instead (through one temporary tensor
    at a time), so that every serving tensor keeps its address: a captured CUDA graph reads its weights
    where they were. Three device copies of the model instead of a pointer exchange; not run on a GPU in
    this project yet."""
    if in_place:
        for a, b in zip(serving.modules(), shadow.modules(), strict=True):
            for mine, theirs in ((a._parameters, b._parameters), (a._buffers, b._buffers)):
                for name, t in mine.items():
                    other = theirs.get(name)
                    if t is None or other is None or t is other:
                        continue
                    spare = t.detach().clone()
                    t.detach().copy_(other.detach())
                    other.detach().copy_(spare)
        return
    for a, b in zip(serving.modules(), shadow.modules(), strict=True):
        a._parameters, b._parameters = b._parameters, a._parameters
        a._buffers, b._buffers = b._buffers, a._buffers
        for name in KERNEL_HANDLES:
            ha, hb = a.__dict__.pop(name, None), b.__dict__.pop(name, None)
            if hb is not None:
                a.__dict__[name] = hb
            if ha is not None:
                b.__dict__[name] = ha


def same_layout(serving: torch.nn.Module, shadow: torch.nn.Module) -> str | None:
    """Why the two copies cannot be exchanged module by module, or None."""
    a, b = list(serving.named_modules()), list(shadow.named_modules())
    if len(a) != len(b):
        return (
            f"the serving model has {len(a)} modules, the shadow {len(b)} (LoRA layers wrap the serving one?)"
        )
    for (na, ma), (nb, mb) in zip(a, b, strict=True):
        if na != nb or type(ma) is not type(mb):
            return f"module {na} ({type(ma).__name__}) is {nb} ({type(mb).__name__}) in the shadow"
        if set(ma._parameters) != set(mb._parameters) or set(ma._buffers) != set(mb._buffers):
            return f"module {na} holds other tensors in the shadow"
        for key, t in [*ma._parameters.items(), *ma._buffers.items()]:
            other = mb._parameters.get(key, mb._buffers.get(key))
            if (t is None) != (other is None) or (
                t is not None and other is not None and (t.shape, t.dtype) != (other.shape, other.dtype)
            ):
                return f"{na}.{key} differs in shape or dtype in the shadow"
    return None
