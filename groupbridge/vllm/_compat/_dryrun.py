"""Check an incoming manifest against what a vLLM model's ``load_weights`` accepts, before bytes move.

vLLM models load checkpoint-format names (``q_proj``, per-expert ``gate_proj``) into fused, possibly sharded
parameters through per-parameter weight loaders, and on CPU and with quantization the loaded parameters are
then replaced by kernel-format tensors (oneDNN-packed, shape ``(0,)`` here). No static table says which
names and shapes a model takes. So the check runs the model's own ``load_weights`` on meta tensors, against
the model-format parameters vLLM recorded at load time for its layerwise reload (on the meta device, so
nothing is allocated or written), then puts the kernel tensors back. The names, the shapes each weight
loader checks and narrows, and that every parameter is fully covered are all checked by the same code
that will load the real bytes.

The same run records which part of each incoming tensor the loaders read (:class:`_Reads`): a worker of a
tensor-parallel engine keeps only its slice of most tensors, so later updates bring it only that box.

It swaps the model's parameters for a moment, so it must run where inference cannot (vLLM calls the
weight-transfer engine from the worker's own thread, between model steps).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...codec import dtype_from_name
from ...weights.manifest import Manifest
from ...weights.shard import Box


@contextmanager
def _model_format_on_meta(model: torch.nn.Module) -> Iterator[None]:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta, to_meta_tensor
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    saved: list[tuple[torch.nn.Module, Any, set[str]]] = []
    try:
        for layer in model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None:
                continue
            if info.can_load():
                raise RuntimeError("a layerwise reload is already in progress on this model")
            saved.append((layer, get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)))
            restore_layer_on_meta(layer, info)
            # tensors vLLM never moves to meta (a bias) get a meta stand-in for the run
            for name, param in list(layer.named_parameters(recurse=False)):
                if not param.is_meta:
                    setattr(layer, name, to_meta_tensor(param))
        yield
    finally:
        for layer, (params, buffers), non_persistent in saved:
            for name in get_layer_tensors(layer):
                delattr(layer, name)
            for name, p in params.items():
                layer.register_parameter(name, p)
            for name, b in buffers.items():
                layer.register_buffer(name, b, persistent=name not in non_persistent)


@contextmanager
def _counting_loaders(model: torch.nn.Module, counts: dict[int, int]) -> Iterator[None]:
    """Wrap each (meta) parameter's weight loader to count the elements it copies in; the wrappers are
    removed on exit (the meta parameters are vLLM's own reload records, reused by every reload)."""
    from vllm.model_executor.model_loader.reload.meta import get_numel_loaded
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    wrapped: list[tuple[torch.Tensor, Any]] = []
    try:
        for p in model.parameters():
            # vLLM's parameter classes keep the loader behind a property (``_weight_loader``): go through it
            loader = getattr(p, "weight_loader", None)
            wrapped.append((p, loader))
            while loader is not None and loader.__name__ == "online_process_loader":
                loader = loader.__wrapped__  # a previous reload's wrapper: the loader it wraps
            _wrap(p, counts, loader or default_weight_loader, get_numel_loaded)
        yield
    finally:
        for t, loader in wrapped:
            if loader is None:
                t.__dict__.pop("weight_loader", None)
            else:
                t.weight_loader = loader  # type: ignore[attr-defined]


def _wrap(p: torch.Tensor, counts: dict[int, int], loader: Callable[..., Any], numel_of: Any) -> None:
    signature = inspect.signature(loader)

    def counted(*args: Any, **kw: Any) -> Any:
        bound = signature.bind(*args, **kw)
        bound.apply_defaults()
        n, ret = numel_of(loader, bound)
        target = bound.arguments.get("param")
        if isinstance(target, torch.Tensor):
            counts[id(target)] = counts.get(id(target), 0) + n
        return ret

    p.weight_loader = counted  # type: ignore[attr-defined]


class _Reads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records, per incoming (meta) tensor, the box of it that any operation reads.

    A weight loader narrows the checkpoint tensor to its rank's slice (views: nothing read) and copies it
    into the parameter (the read). Every operator an incoming tensor or a view of it enters as an input it
    does not alias is a read of the elements that view covers; a view that is not a box of the tensor (a
    stride it does not have: a transpose of a slice, an expand) counts as the whole tensor, as does any read
    of a tensor derived from it (a dtype conversion, then a narrow: the conversion read what it covered).
    So the boxes are never smaller than what the loaders use: a view of another element size (``view(dtype)``)
    counts as the whole tensor, and anything the recording cannot read (a tensor without storage) makes
    ``broken`` true, after which every tensor counts as read whole. The recording never raises into a loader.
    """

    def __init__(self, metas: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._roots = {
            t.untyped_storage()._cdata: (name, tuple(t.shape), t.element_size()) for name, t in metas
        }
        self.boxes: dict[str, Box] = {}
        self.broken = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.broken:
            try:
                self._reads_of(func, args, kwargs)
            except Exception:
                self.broken = True
        return func(*args, **kwargs)

    def _reads_of(self, func: Any, args: Any, kwargs: Any) -> None:
        schema = func._schema.arguments
        for i, a in enumerate(args):
            alias = schema[i].alias_info if i < len(schema) else None
            aliased = alias is not None and not alias.is_write  # a view's input: nothing read
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) and not aliased:
                    self._read(t)
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                self._read(v)

    def _read(self, t: torch.Tensor) -> None:
        root = self._roots.get(t.untyped_storage()._cdata)
        if root is None or t.numel() == 0:
            return
        name, shape, size = root
        if t.element_size() != size:  # offsets and strides in other units: the whole tensor
            box = Box((0,) * len(shape), shape)
        else:
            box = _box_of_view(shape, int(t.storage_offset()), tuple(t.shape), t.stride())
        had = self.boxes.get(name)
        self.boxes[name] = box if had is None else _hull(had, box)


def _box_of_view(shape: tuple[int, ...], offset: int, view: tuple[int, ...], strides: tuple[int, ...]) -> Box:
    """The box of a contiguous tensor of ``shape`` that a view of it covers; the whole tensor when the view
    is not a box (see :class:`_Reads`)."""
    whole = Box((0,) * len(shape), shape)
    rstrides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        rstrides[k] = rstrides[k + 1] * shape[k + 1]
    start, rest = [], offset
    for k in range(len(shape)):
        start.append(rest // rstrides[k] if shape[k] else 0)
        rest -= start[-1] * rstrides[k]
    extent = [1] * len(shape)
    used: set[int] = set()
    for size, stride in zip(view, strides, strict=True):
        if size == 1:
            continue
        ks = [k for k in range(len(shape)) if rstrides[k] == stride and shape[k] > 1 and k not in used]
        if not ks:
            return whole
        used.add(ks[0])
        extent[ks[0]] = size
    box = Box(tuple(start), tuple(extent))
    return box if box.within(shape) else whole


def _hull(a: Box, b: Box) -> Box:
    lo = tuple(min(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    hi = tuple(max(x, y) for x, y in zip(a.end(), b.end(), strict=True))
    return Box(lo, tuple(h - x for x, h in zip(lo, hi, strict=True)))


def check_loadable(
    model: torch.nn.Module,
    manifest: Manifest,
    *,
    complete: bool = True,
    reads: dict[str, Box | None] | None = None,
) -> str | None:
    """None if ``model.load_weights`` takes every entry of ``manifest`` (and, with ``complete``, the
    entries fill every parameter), else a message saying which names or shapes it refuses. ``reads`` (when
    the manifest is taken) receives the box of each entry the loaders read, where that is not the whole
    entry (a tensor-parallel rank's slice), and None for each entry they do not read at all (a tied
    ``lm_head`` the model skips)."""
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    metas = [
        (e.name, torch.empty(e.shape, dtype=dtype_from_name(e.wire_dtype), device="meta"))
        for e in manifest.entries
    ]
    # tied parameters (an lm_head sharing the embedding) are one tensor in the served model but two in the
    # meta view (vLLM records each layer's own): written through either name, both are
    shared: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(n)
    tied = [names for names in shared.values() if len(names) > 1]
    counts: dict[int, int] = {}
    seen = _Reads(metas)
    with _model_format_on_meta(model), _counting_loaders(model, counts):
        params = dict(model.named_parameters(remove_duplicate=False))
        try:
            with seen:
                model.load_weights(iter(metas))  # type: ignore[operator]
        except Exception:
            counts.clear()
            for name, meta in metas:  # again one by one, to name the entry the model refuses
                try:
                    model.load_weights(iter([(name, meta)]))  # type: ignore[operator]
                except Exception as e:
                    return (
                        f"the model ({type(model).__name__}) cannot load {name!r} {tuple(meta.shape)} "
                        f"{meta.dtype}: {type(e).__name__}: {str(e)[:300]}"
                    )
            return f"the model ({type(model).__name__}) cannot load the update as a whole"
        if complete:
            missing = {n for n, p in params.items() if counts.get(id(p), 0) < get_tensor_load_numel(p)}
            for names in tied:
                if not all(n in missing for n in names):
                    missing.difference_update(names)
            short = [
                f"{n} ({counts.get(id(params[n]), 0)} of {get_tensor_load_numel(params[n])} elements)"
                for n in params
                if n in missing
            ]
            if short:
                return (
                    f"the update leaves {len(short)} of the model's parameters not fully written: "
                    f"{', '.join(short[:10])}{' ...' if len(short) > 10 else ''}"
                )
    if reads is not None and seen.broken:
        reads.clear()  # every tensor whole
    elif reads is not None:
        shapes = {e.name: tuple(e.shape) for e in manifest.entries}
        reads.clear()
        reads.update((name, box) for name, box in seen.boxes.items() if box.shape != shapes[name])
        reads.update((name, None) for name in shapes if name not in seen.boxes)
    return None
