"""What a source's pair streams read (see :mod:`._sharded`): its boxes by wire name, a lazy source pulled as
the buckets that read them are packed (:class:`SourceSlots`), and the digests of the replicated cells it
holds, for the vote."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial

import torch
import xxhash

from ..codec import dtype_from_name
from ..control import Deadline
from ..errors import CopyTimeoutError
from . import _bytes
from ._described import Boxes, Pairs
from ._shard_plan import Piece, ShardPlan
from ._source import Puller, SourceReads
from .manifest import Manifest
from .plan import Plan
from .shard import Box


class SourceSlots:
    """Where this source's boxes live, by wire name. A list of pairs is read at once; a lazy source is
    pulled (on the caller's thread) as the buckets that read its tensors are packed, each tensor checked
    against the manifest and let go once the last of those buckets is packed."""

    def __init__(
        self, manifest: Manifest, items: Pairs, shards: Boxes, plan: ShardPlan, me: int, kept: _bytes.Kept
    ) -> None:
        self._shards, self._dtypes, self._kept = shards, plan.dtypes, kept
        self._lazy = not isinstance(items, list)
        self._puller = Puller(manifest, iter(items)) if self._lazy else None
        self._slots: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
        """By wire name: the tensor held, and where its box starts in the global tensor."""
        self._replicated: dict[str, list[Box]] = {}
        for name, cell, holders in plan.replicated:
            if me in holders:
                self._replicated.setdefault(name, []).append(cell)
        self._replicas: dict[str, Future[str]] = {}
        self._hasher: ThreadPoolExecutor | None = None
        self._left: Counter[str] = Counter()
        if self._lazy:
            self._left.update(
                p.name for (src, _), cut in plan.pairs.items() if src == me for b in cut.buckets for p in b
            )
        else:  # the manifest was built from this very list: nothing to check it against
            for name, t in items:
                self._hold(name, t.detach() if t.requires_grad else t)

    def reads(self, cut: Plan[Piece]) -> SourceReads:
        """How a pair's stream cut by ``cut`` reads this source."""
        return SourceReads(
            cut,
            pack=lambda k, into: self.pack(cut.buckets[k], into),
            pull=lambda k: self.need(cut.buckets[k]),
            release=lambda k: self.packed(cut.buckets[k]),
        )

    def pack(self, pieces: tuple[Piece, ...], into: torch.Tensor) -> None:
        slots = self._slots
        # Where each piece lies in its tensor is the plan's (the boxes held are in the handshake's posts), so
        # it is worked out once per plan; a sync then only looks its tensors up.
        recipe = self._kept.get(pieces, "recipe", None, partial(self._recipe, pieces))
        parts = [
            (offset, nbytes, slots[name][0] if box is None else slots[name][0][box], dtype)
            for name, offset, nbytes, box, dtype in recipe
        ]
        at = self._kept.get(
            pieces, "pack", _bytes.address(into), lambda: _bytes.layout(into, parts, runs=True)
        )
        _bytes.copy_in(parts, at)

    def _recipe(
        self, pieces: tuple[Piece, ...]
    ) -> list[tuple[str, int, int, tuple[slice, ...] | None, torch.dtype]]:
        """Per piece: its tensor, its place in the bucket, its slices of the tensor (None: all of it), and
        the dtype it travels as."""
        out = []
        for p in pieces:
            t, offset = self._slots[p.name]
            held = Box(offset, tuple(t.shape))
            at = None if p.box == held else p.box.slices(offset)
            out.append((p.name, p.offset, p.nbytes, at, dtype_from_name(self._dtypes[p.name])))
        return out

    def need(self, pieces: tuple[Piece, ...]) -> None:
        """Pull every tensor these pieces (a bucket's) read."""
        for p in pieces:
            while p.name not in self._slots:
                if not self._pull():  # pulled every entry: the plan names one the manifest does not
                    raise ValueError(f"the plan reads {p.name!r}, which this source's manifest does not list")

    def packed(self, pieces: tuple[Piece, ...]) -> None:
        """A bucket of these pieces is packed: a lazy source's tensors no later bucket reads are let go."""
        if not self._lazy:
            return
        for p in pieces:
            self._left[p.name] -= 1
            if self._left[p.name] <= 0:
                self._slots.pop(p.name, None)

    def replicas(self, deadline: Deadline) -> dict[str, str]:
        """The digest of every replicated cell this source holds (see ``ShardPlan.replicated``), for the
        vote to compare across each cell's holders. Taken on a thread of their own as tensors are pulled
        (hashing releases the GIL), so they overlap the stream instead of adding to it."""
        try:
            return {where: f.result(timeout=max(deadline.left(), 0.0)) for where, f in self._replicas.items()}
        except FutureTimeout:
            raise CopyTimeoutError(f"digesting this source's replicated cells ran past {deadline}") from None
        finally:
            self.close()

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=False, cancel_futures=True)
            self._hasher = None

    def finish(self) -> None:
        """Pull the rest (a generator that gathers runs to its end on every source alike)."""
        while self._pull():
            pass

    def _pull(self) -> bool:
        if self._puller is None or self._puller.done:
            return False
        _, e, t = self._puller.take()
        self._hold(e.name, t)
        return True

    def _hold(self, name: str, t: torch.Tensor) -> None:
        """Keep tensor ``t`` of ``name`` where the plan reads it, its replicated cells' digests under way."""
        offset = self._shards[name][1] if name in self._shards else (0,) * t.dim()
        for cell in self._replicated.get(name, ()):
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="groupbridge-replicas")
            where = f"{name} at {list(cell.offset)} of shape {list(cell.shape)}"
            self._replicas[where] = self._hasher.submit(_cell_digest, t[cell.slices(offset)])
        if self._left[name] > 0 or not self._lazy:
            self._slots[name] = (t, offset)


def _cell_digest(cell: torch.Tensor) -> str:
    data = cell.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data
    return f"{xxhash.xxh3_64_intdigest(data):016x}"
