"""The sender's side of a sync's source: tensors pulled as buckets need them, checked, released."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..codec import dtype_from_name
from .manifest import Manifest
from .plan import Plan

__all__ = ["Puller"]


class Puller:
    """Pulls (name, tensor) pairs from the source as buckets need them, checking each against the manifest;
    a lazy source's tensor is released as soon as its last bucket is sent."""

    def __init__(self, manifest: Manifest, items: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.manifest = manifest
        self.entries = manifest.entries
        self.wire = [dtype_from_name(e.wire_dtype) for e in self.entries]
        self.live: list[torch.Tensor | None] = [None] * len(self.entries)
        """The source's tensors, as they are (cast to the wire dtype only when packed)."""
        self.direct: list[torch.Tensor | None] = [None] * len(self.entries)
        """The tensors already contiguous in their wire dtype: the ones a bucket may be sent from in place."""
        self._items = items
        self._pulled = 0

    def pull_through(self, index: int) -> None:
        entries = self.entries
        while self._pulled <= index:
            try:
                name, t = next(self._items)
            except StopIteration:
                raise ValueError(
                    f"the named tensors ended after {self._pulled} of {len(entries)} entries of the manifest"
                ) from None
            e = entries[self._pulled]
            if name != e.name or tuple(t.shape) != e.shape or str(t.dtype).removeprefix("torch.") != e.dtype:
                raise ValueError(
                    f"tensor #{self._pulled} is {name!r} {list(t.shape)} {t.dtype}; the manifest says "
                    f"{e.name!r} {list(e.shape)} {e.dtype} (the order and shapes must not change)"
                )
            if e.alias_of is None and e.nbytes:
                src = t.detach()
                if src.dtype == self.wire[self._pulled]:
                    src = src.contiguous()
                    self.direct[self._pulled] = src
                self.live[self._pulled] = src
            self._pulled += 1

    def release(self, plan: Plan, k: int) -> None:
        """Drop the tensors whose last bytes are in bucket ``k`` (sent or diffed by now)."""
        for seg in plan.buckets[k]:
            if seg.tensor_offset + seg.nbytes == self.entries[seg.index].nbytes:
                self.live[seg.index] = self.direct[seg.index] = None
