"""``gb.Shard``: a box of a global tensor, as a value a source sends or a receiver wants.

A trainer that shards its model (FSDP2, tensor or expert parallel) holds, per parameter, a box of the global
tensor: ``Shard(local, global_shape, offset)`` says which, and a DTensor says it itself (:func:`box_of`). A
plain tensor, on either side, is the whole tensor.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["Box", "Shard", "box_of"]


@dataclass(frozen=True, slots=True)
class Box:
    """A box of a global tensor: ``offset`` and ``shape``, one int per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=True))

    def contains(self, other: Box) -> bool:
        return all(a <= b for a, b in zip(self.offset, other.offset, strict=True)) and all(
            a >= b for a, b in zip(self.end(), other.end(), strict=True)
        )

    def within(self, global_shape: Sequence[int]) -> bool:
        return len(self.offset) == len(global_shape) and all(
            o >= 0 and o + s <= g and s >= 0
            for o, s, g in zip(self.offset, self.shape, global_shape, strict=True)
        )

    def slices(self, origin: Sequence[int]) -> tuple[slice, ...]:
        """This box as slices of a tensor that holds the box starting at ``origin``."""
        return tuple(slice(o - b, o - b + s) for o, s, b in zip(self.offset, self.shape, origin, strict=True))

    def to_wire(self) -> list[list[int]]:
        return [list(self.offset), list(self.shape)]


class Shard:
    """``tensor`` holds the box of a global tensor of ``global_shape`` that starts at ``offset``: a source
    sends its box's bytes, a receiver's target (a tensor-parallel slice) receives only its box. Raises
    ValueError or TypeError at once when the box does not fit the global shape."""

    __slots__ = ("global_shape", "offset", "tensor")

    def __init__(self, tensor: torch.Tensor, global_shape: Sequence[int], offset: Sequence[int]) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Shard takes a tensor, got {type(tensor).__name__}")
        gs, off = tuple(global_shape), tuple(offset)
        if not all(type(v) is int for v in (*gs, *off)):
            raise TypeError(f"global_shape={list(gs)} and offset={list(off)} must be ints")
        if len(gs) != tensor.dim() or len(off) != tensor.dim():
            raise ValueError(
                f"a {tensor.dim()}-d tensor needs a global_shape and an offset of {tensor.dim()} ints, got "
                f"{list(gs)} and {list(off)}"
            )
        if not Box(off, tuple(tensor.shape)).within(gs):
            raise ValueError(
                f"a box of shape {list(tensor.shape)} at offset {list(off)} lies outside a tensor of shape "
                f"{list(gs)}"
            )
        self.tensor = tensor
        self.global_shape = gs
        self.offset = off

    @property
    def box(self) -> Box:
        return Box(self.offset, tuple(self.tensor.shape))

    @property
    def whole(self) -> bool:
        return self.global_shape == tuple(self.tensor.shape)

    def __repr__(self) -> str:
        return (
            f"Shard({list(self.tensor.shape)} {self.tensor.dtype} of {list(self.global_shape)} at "
            f"{list(self.offset)})"
        )


def box_of(value: Any) -> Shard | None:
    """The value as a :class:`Shard` (a Shard, or a DTensor's local box), or None for a plain tensor. A
    DTensor's box is read from its placements and mesh (no ``full_tensor()``): ``Shard(dim)`` splits the
    global tensor as ``torch.chunk`` does (as FSDP2 and tensor parallel do), ``Replicate`` holds it whole
    along that mesh dimension; ``Partial`` (a pending reduction) cannot be sent and raises ValueError."""
    if isinstance(value, Shard):
        return value
    module = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor exists
    if module is None or not isinstance(value, module.DTensor):
        return None
    return _dtensor_box(value)


def _dtensor_box(value: DTensor) -> Shard:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    local = value.to_local()
    global_shape = tuple(value.shape)
    offset = [0] * len(global_shape)
    coords = value.device_mesh.get_coordinate()
    if coords is None:  # this rank is not in the mesh: it holds nothing
        raise ValueError("a DTensor on a mesh this rank is not part of holds no box to send")
    sizes = list(global_shape)
    for mesh_dim, placement in enumerate(value.placements):
        if isinstance(placement, DShard):
            d = placement.dim
            n = value.device_mesh.size(mesh_dim)
            chunk = -(-sizes[d] // n)  # torch.chunk's split: ceil-sized pieces, the last ones short or empty
            start = min(coords[mesh_dim] * chunk, sizes[d])
            offset[d] += start
            sizes[d] = max(0, min(chunk, sizes[d] - start))
        elif not isinstance(placement, Replicate):
            raise ValueError(f"a DTensor placement {placement} (a pending reduction) has no box to send")
    if tuple(local.shape) != tuple(sizes):
        raise ValueError(
            f"a DTensor's local tensor is {list(local.shape)}, its placements say {sizes}: uneven sharding "
            "other than torch.chunk's is not supported"
        )
    return Shard(local, global_shape, offset)
