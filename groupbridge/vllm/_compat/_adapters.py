"""Adapters from memory: a worker's LoRA loader asks its engine's :class:`~groupbridge.vllm._lora.Adapters`
about each load, on the workers of engines attached to groupbridge alone; and the handshake's check that an
adapter fits the model.

Private reads: ``WorkerLoRAManager._load_adapter`` (wrapped on one worker's loader), ``_adapter_manager``,
``_lora_model_cls``, ``_active_adapters``, ``supported_lora_modules``, ``packed_modules_mapping``,
``PEFTHelper``, ``parse_fine_tuned_lora_name``, and the LoRA layers' ``base_layer`` and sizes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from .. import _lora
from .._lora import AdapterSpec
from ._gate import private


def serve_adapters(manager: Any, adapters: _lora.Adapters) -> None:
    """Have one worker's LoRA loader (its ``WorkerLoRAManager``) ask ``adapters`` about every load (see
    :meth:`~groupbridge.vllm._lora.Adapters.check_load`): its ``_load_adapter`` is wrapped on that object
    alone, so the class, and every worker of another engine, load as vLLM does. Called again, it serves the
    ``adapters`` given last."""
    if manager is None:  # no LoRA layers: the handshake refuses adapters (``_lora.check_adapter``)
        return
    original = private(manager, "_load_adapter")
    served = getattr(original, "_groupbridge", None)
    if served is not None:  # wrapped already: serve this worker engine's adapters from now on
        served[0] = adapters
        return
    served = [adapters]

    @functools.wraps(original)
    def load(lora_request: Any) -> Any:
        full = served[0].check_load(str(lora_request.lora_path), str(lora_request.lora_name))
        if full is None:
            return original(lora_request)
        tensors, config = served[0].filed(full)
        return _lora_model(manager, lora_request, tensors, config)

    load._groupbridge = served  # type: ignore[attr-defined]
    manager._load_adapter = load


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
    manager = getattr(model, "lora_manager", None)  # a model without LoRA layers has none: nothing loaded
    return set() if manager is None else set(private(manager, "_active_adapters"))


def _expected_modules(manager: Any) -> set[str]:
    """The module names an adapter may target in this model (vLLM's own rule, packed modules unpacked)."""
    expected: set[str] = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
    return expected


def check_adapter(
    model: torch.nn.Module, vllm_config: Any, spec: AdapterSpec, shapes: Iterable[tuple[str, tuple[int, ...]]]
) -> str | None:
    """Why this engine cannot serve ``spec`` with tensors of these (name, shape), or None: LoRA enabled, the
    rank within ``max_lora_rank``, ``max_live`` within ``max_cpu_loras``, every tensor a lora_A/lora_B of a
    module the model has, shaped for it (lora_A ``(r, in)``, lora_B ``(out, r)``, the layer's whole sizes:
    an adapter made for another model's sizes would be served as garbage). Runs in the handshake, before any
    byte moves."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    lora_config = getattr(vllm_config, "lora_config", None)
    manager = getattr(model, "lora_manager", None)
    if lora_config is None or manager is None:
        return "this engine serves no adapters: start it with enable_lora=True (and max_lora_rank)"
    try:
        PEFTHelper.from_dict(dict(spec.config)).validate_legal(lora_config)
    except Exception as e:
        return f"adapter {spec.name!r} cannot be served here: {e}"
    if spec.max_live > lora_config.max_cpu_loras:
        return (
            f"max_live_adapters={spec.max_live} exceeds the engine's max_cpu_loras="
            f"{lora_config.max_cpu_loras}: start it with max_cpu_loras (and max_loras) at least that"
        )
    expected = _expected_modules(manager)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    for name, shape in shapes:
        try:
            module, is_a = parse_fine_tuned_lora_name(name, mapper)[:2]
        except Exception:
            return f"{name!r} is not a LoRA tensor (lora_A / lora_B of a module)"
        parent, _, leaf = module.rpartition(".")
        if leaf not in expected:
            return f"{name!r} targets {leaf!r}; this model's adapters may target {sorted(expected)}"
        try:
            owner = model.get_submodule(parent)
        except AttributeError:
            return f"{name!r}: this model has no {parent!r}"
        sizes = _layer_sizes(owner, leaf, manager.packed_modules_mapping)
        if sizes is None or len(shape) != 2:
            continue  # a layer whose sizes this check cannot read: vLLM's own load checks what it can
        want = sizes[0] if is_a else sizes[1]
        got = shape[1] if is_a else shape[0]
        if got != want:
            side = "input" if is_a else "output"
            return (
                f"{name!r} has {side} size {got} where this model's {parent}.{leaf} has {want}: an adapter "
                "made for another model's sizes"
            )
    return None


def _layer_sizes(owner: torch.nn.Module, leaf: str, packed: dict[str, list[str]]) -> tuple[int, int] | None:
    """(input, output) sizes, whole (not one tensor-parallel rank's), of the layer ``leaf`` names under
    ``owner``: its own, or its part of a fused layer (``q_proj`` of ``qkv_proj``); None when not read."""
    layer, part = getattr(owner, leaf, None), None
    if layer is None:
        for fused, parts in packed.items():
            if leaf in parts and isinstance(getattr(owner, fused, None), torch.nn.Module):
                layer, part = getattr(owner, fused), parts.index(leaf)
                break
    layer = getattr(layer, "base_layer", layer)  # LoRA wraps the layer it serves
    n_in, n_out, outs = (getattr(layer, k, None) for k in ("input_size", "output_size", "output_sizes"))
    if part is not None:
        n_out = outs[part] if isinstance(outs, (list, tuple)) and part < len(outs) else None
    return (n_in, n_out) if isinstance(n_in, int) and isinstance(n_out, int) else None
