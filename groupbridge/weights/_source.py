"""A source's tensors pulled as its streams' buckets need them, checked against the manifest, released after
their last bucket (:class:`Puller`), and what a stream reads each bucket from (:class:`SourceReads`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..codec import dtype_from_name
from . import _bytes
from .manifest import DTYPE_NAMES, Entry, Manifest
from .plan import Plan


def _nothing(k: int) -> None:
    return None


@dataclass(frozen=True, slots=True)
class SourceReads:
    """Where a source's stream reads each bucket of its cut from: what a full stream's fill
    (``_tx_stream.Packed``) and a delta's diff (``_delta_tx.Diffs``) take, whether the cut's buckets hold a
    manifest's segments (a fan-out, :meth:`Puller.reads`) or boxes (a pair, ``SourceSlots.reads``)."""

    cut: Plan[Any]
    pack: Callable[[int, torch.Tensor], None]
    """Pack bucket k into a buffer (on a copy thread)."""
    pull: Callable[[int], None] = _nothing
    """Pull the tensors bucket k reads, on the caller's thread (where a lazy source yields them)."""
    release: Callable[[int], None] = _nothing
    """Bucket k was sent or diffed: let go what no later bucket reads."""
    direct: Callable[[int], torch.Tensor | None] = _nothing
    """Bucket k's bytes where they lie, when the source is laid out as its cut (sent with no copy)."""


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

    @property
    def done(self) -> bool:
        """Every entry of the manifest was pulled."""
        return self._pulled == len(self.entries)

    def take(self) -> tuple[int, Entry, torch.Tensor]:
        """The source's next tensor, checked against the manifest: (its index, its entry, the tensor,
        detached). ValueError when the source ends early or its tensor is not the entry's."""
        entries, index = self.entries, self._pulled
        try:
            name, t = next(self._items)
        except StopIteration:
            raise ValueError(
                f"the named tensors ended after {index} of {len(entries)} entries of the manifest"
            ) from None
        e = entries[index]
        if name != e.name or t.shape != e.shape or DTYPE_NAMES.get(t.dtype) != e.dtype:
            raise ValueError(
                f"tensor #{index} is {name!r} {list(t.shape)} {t.dtype}; the manifest says "
                f"{e.name!r} {list(e.shape)} {e.dtype} (the order and shapes must not change)"
            )
        self._pulled += 1
        return index, e, t.detach()

    def pull_through(self, index: int) -> None:
        """Pull every tensor up to entry ``index``, keeping each by its index (see :attr:`live`)."""
        while self._pulled <= index:
            i, e, src = self.take()
            if e.alias_of is None and e.nbytes:
                if src.dtype == self.wire[i]:
                    src = src.contiguous()
                    self.direct[i] = src
                self.live[i] = src

    def finish(self) -> None:
        """Pull the rest of the manifest's entries (trailing tied names and empty tensors)."""
        self.pull_through(len(self.entries) - 1)

    def reads(self, plan: Plan) -> SourceReads:
        """How a fan-out stream cut by ``plan`` reads this source."""
        return SourceReads(
            plan,
            pack=lambda k, into: _bytes.pack(into, plan.buckets[k], self.live, self.wire),
            pull=lambda k: self.pull_through(max(seg.index for seg in plan.buckets[k])),
            release=partial(self.release, plan),
            direct=lambda k: _bytes.in_place_bucket(plan, k, self.direct, receiving=False),
        )

    def release(self, plan: Plan, k: int) -> None:
        """Drop the tensors whose last bytes are in bucket ``k`` (sent or diffed by now)."""
        for seg in plan.buckets[k]:
            if seg.tensor_offset + seg.nbytes == self.entries[seg.index].nbytes:
                self.live[seg.index] = self.direct[seg.index] = None
