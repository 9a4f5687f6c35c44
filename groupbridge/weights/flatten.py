"""flatten_: lay a model's tensors out, in place, as views of one buffer in the bucket plan's byte layout."""

from __future__ import annotations

from typing import Any

import torch

from ..codec import dtype_from_name
from . import _bytes
from .manifest import Manifest, tensors_of
from .plan import stream_offsets

__all__ = ["flatten_"]


def flatten_(module_or_state_dict: Any, *, wire_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Re-lay every tensor of a module or state dict as a view of one new buffer; return the buffer.

    The byte layout is exactly the bucket plan's (which does not depend on the bucket size), so a side whose
    tensors are laid out this way sends or receives every bucket in place, without packing copies. Tensors
    keep their identity (``t.data`` is swapped): parameters stay parameters, optimizers that hold them keep
    working, and tied tensors stay tied. Do it once, before syncing; it costs one copy of the model.
    """
    targets = tensors_of(module_or_state_dict, "flatten_()")
    if not targets:
        return torch.empty(0, dtype=torch.uint8)
    manifest = Manifest.build(list(targets.items()), wire_dtype)
    offsets, total = stream_offsets(manifest)
    devices = {t.device for t in targets.values()}
    if len(devices) != 1:
        raise ValueError(f"flatten_ needs every tensor on one device, found {sorted(map(str, devices))}")
    buf = _bytes.new_buffer(total, devices.pop())
    tensors = list(targets.values())
    with torch.no_grad():
        for i, e in enumerate(manifest.entries):
            if e.alias_of is not None:
                continue
            if e.dtype != e.wire_dtype:
                continue  # cast on the wire: this tensor cannot be sent in place anyway
            view = _bytes.typed_view(buf, offsets[i], dtype_from_name(e.dtype), e.shape)
            view.copy_(tensors[i])
            tensors[i].data = view
    return buf
