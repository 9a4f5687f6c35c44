"""The worker's model: vLLM's layerwise reload, the shadow (a second copy of the model, loaded and processed
while the serving copy serves, whose tensors are exchanged into the serving copy's modules at the commit),
and the CPU kernel set-up vLLM skips after a reload.

Private reads: ``model_loader.reload`` (``initialize_layerwise_reload``, ``finalize_layerwise_reload``),
``get_model`` under ``set_current_vllm_config``, ``rotary_embedding._ROPE_DICT``,
``compilation_config.static_forward_context``, the modules' ``_parameters``/``_buffers``, the CPU GEMM handle
``cpu_linear``, ``quant_method.moe_kernel.fused_experts``, ``get_world_group().rank_in_group``.
"""

from __future__ import annotations

from typing import Any

import torch


def on_cpu() -> bool:
    """Whether vLLM runs this worker on the CPU platform."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def rank_in_world() -> int:
    """This worker's rank in its engine's world (tensor and pipeline parallel ranks)."""
    from vllm.distributed.parallel_state import get_world_group

    return int(get_world_group().rank_in_group)


def begin_reload(model: torch.nn.Module) -> None:
    """vLLM's layerwise reload begins: the model's parameters go to the meta device until each layer is
    whole again, then are processed (its ``process_weights_after_loading``)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def end_reload(model: torch.nn.Module, model_config: Any) -> None:
    """vLLM's layerwise reload ends: layers not yet whole are restored and processed; never leaves the
    model on the meta device, whatever was loaded."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def checkpoint_gone(vllm_config: Any) -> str | None:
    """The engine's checkpoint, when it was a local directory that is no longer there (an exported policy
    in scratch space, removed once the engine started): a shadow is loaded from it, so it cannot be built.
    None when it is there, or may be a hub name (``org/name``: whose failure, if any, is the loader's own,
    and fails the join naming ``swap="reload"``)."""
    import os

    path = str(vllm_config.model_config.model)
    local = os.path.isabs(path) or path.startswith(("./", "../", "~"))  # else perhaps a hub name
    return path if local and not os.path.exists(os.path.expanduser(path)) else None


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


def tied_layers(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The groups of layers with a kernel (a ``quant_method``) whose weights share one tensor."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        weight = layer._parameters.get("weight")
        if weight is not None and weight.numel() > 0 and getattr(layer, "quant_method", None) is not None:
            owners.setdefault(weight.data_ptr(), []).append(layer)
    return [layers for layers in owners.values() if len(layers) > 1]


def cpu_kernel_handles(model: torch.nn.Module) -> dict[int, int]:
    """``id(handle)`` of each tied layer's CPU GEMM handle (``cpu_linear``, made anew whenever vLLM processes
    the layer's weights), by ``id(layer)``: taken before a reload, it tells :func:`refresh_cpu_kernels`
    which tied layers the reload processed. Ids, not the handles: a handle holds the layer's packed weights,
    and keeping the old ones alive through the reload would hold a second copy of them. Empty off the CPU
    (nothing to refresh there: no walk of the model per update)."""
    if not on_cpu():
        return {}
    return {
        id(layer): id(handle)
        for layers in tied_layers(model)
        for layer in layers
        if (handle := layer.__dict__.get("cpu_linear")) is not None
    }


def refresh_cpu_kernels(model: torch.nn.Module, before: dict[int, int] | None = None) -> int:
    """Redo CPU kernel set-up that vLLM 0.32 skips after a reload; returns how many layers were redone.

    Both are vLLM bugs measured here (its own ``reload_weights`` has them too):

    - the unquantized MoE method runs its experts' ``process_weights_after_loading`` (on CPU: packing
      ``w13``/``w2`` into the grouped-GEMM layout) only when the kernel is first built, never on a weight
      update: after a reload the kernel reads unpacked weights (reloading the very weights a Qwen3-MoE was
      started with changed its greedy tokens);
    - a layer whose weight is tied to another's (an ``lm_head`` sharing the embedding) receives nothing in
      a reload, so its packed GEMM handle (``dispatch_cpu_unquantized_gemm``) is never rebuilt and keeps
      the old weights' values although the shared tensor holds the new ones.

    ``before`` (:func:`cpu_kernel_handles` taken before the reload): a tied layer whose handle the reload
    made anew (the one that received the shared weight) is not packed again; without it, or when in doubt
    (a handle whose id is the old one's, no handle), every tied layer is. The dense benchmark's 272 MB
    embedding is one oneDNN packing less per update: about 0.2 s of the commit in vLLM's worker, which
    computes on one core of a 2-core host (measured 2026-12-02).
    """
    if not on_cpu():
        return 0
    redone = 0
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
    for layers in tied_layers(model):
        for layer in layers:
            handle = layer.__dict__.get("cpu_linear")
            if before is not None and handle is not None and id(handle) != before.get(id(layer)):
                continue  # made anew by the reload, from the new weights
            layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
            redone += 1
    return redone
