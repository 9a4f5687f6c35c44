"""Every member's delta bases (:class:`Bases`) and what of them outlives one bridge (:class:`DeltaMemory`).

A pair's base is its buckets back to back (cut named by :func:`pair_key`), a fan-out stream's the manifest's
plan-layout bytes (:data:`FANOUT`). A base holds a version only once its sync committed, so after any failure
that stream's next sync is whole; a new or lagging receiver makes only its own pairs whole."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codec import dtype_from_name
from . import _bytes
from ._shard_plan import Piece
from .plan import Plan


def pair_key(cut: Plan[Piece]) -> str:
    """Names a pair's cut: two syncs with the same key lay the pair's bytes out alike."""
    layout = [
        (end - start, [(p.name, p.box.offset, p.box.shape, p.offset) for p in pieces])
        for (start, end), pieces in zip(cut.bounds, cut.buckets, strict=True)
    ]  # a pickle of ints and strs: the same bytes for the same cut, at C speed (repr of 10^5 pieces is not)
    return hashlib.sha256(pickle.dumps(layout, protocol=5)).hexdigest()[:32]


def bucket_word(pieces: tuple[Piece, ...], dtypes: Any) -> int:
    """The comparison word of a pair's bucket: its smallest element size (pieces are 16-byte aligned whole
    elements, so every piece and the bucket are whole words)."""
    return min((dtype_from_name(dtypes[p.name]).itemsize for p in pieces), default=1)


FANOUT = -1
"""The peer under which :class:`Bases` keeps a fan-out stream's base: a source's one base for all receivers
(keyed by the manifest's digest), a receiver's kept buffer or target (keyed by :func:`kept_key`)."""


def kept_key(how: tuple[Any, ...], digest: str) -> str:
    """Names a receiver's fan-out base: how it is kept (the kept buffer for ``receive()``, or which target
    and how it is received into) and the manifest whose plan lays it out."""
    return repr((how, digest))


class Bases:
    """One member's delta bases, one per cut with the version it holds. Pairs with the same cut share one
    (two replicas' tensor-parallel rank 0s want the same rows from a source), diffed and kept once."""

    def __init__(self) -> None:
        self._bases: dict[str, tuple[int | None, torch.Tensor]] = {}
        """key of the cut -> (the version held, or None while a sync is rewriting it; the bytes)."""
        self._peers: dict[int, str] = {}
        """peer -> the key of the cut of the pair with it."""
        self._begun: set[str] = set()

    def held(self, peer: int, key: str) -> int | None:
        """The version this member holds for the pair with ``peer``, if its cut is ``key``."""
        base = self._bases.get(key) if self._peers.get(peer) == key else None
        return base[0] if base is not None else None

    def begin(self, peer: int, key: str, nbytes: int, device: torch.device) -> tuple[torch.Tensor, bool]:
        """The base of the pair with ``peer`` for this sync, invalid until :meth:`commit` (the kept bytes if
        the cut is the same), and whether this sync began it already for a pair of the same cut."""
        again = key in self._begun
        self._peers[peer] = key
        self._drop_unused()  # free what no pair cuts so any more before allocating
        base = self._bases.get(key)
        if base is None or base[1].numel() != nbytes:
            self._bases.pop(key, None)
            buffer = _bytes.new_buffer(nbytes, device)
        elif base[1].device != device:  # the member's tensors moved: its base (the verdicts said held) too
            buffer = _bytes.new_buffer(nbytes, device)
            buffer.copy_(base[1])
        else:
            buffer = base[1]
        self._bases[key] = (None, buffer)
        self._begun.add(key)
        return buffer, again

    def adopt(self, peer: int, key: str) -> None:
        """A base with ``peer`` whose bytes live elsewhere (a receiver's kept buffer or target), known by
        ``key`` only, invalid until :meth:`commit`."""
        self._peers[peer] = key
        self._bases[key] = (None, torch.empty(0, dtype=torch.uint8))
        self._begun.add(key)

    def drop(self, peer: int) -> None:
        """The stream with ``peer`` holds no base any more (its bytes are about to be rewritten)."""
        key = self._peers.pop(peer, None)
        if key is not None and key not in self._peers.values():
            self._bases.pop(key, None)
            self._begun.discard(key)

    def invalidate(self, peer: int) -> None:
        """The stream with ``peer`` holds no valid version (its bytes stay, for the next sync to reuse)."""
        key = self._peers.get(peer)
        if key is not None and key in self._bases:
            self._bases[key] = (None, self._bases[key][1])

    def commit(self, version: int) -> None:
        """The sync committed: every base begun in it holds ``version``."""
        for key in self._begun:
            self._bases[key] = (version, self._bases[key][1])
        self._begun.clear()

    def abandon(self) -> None:
        """The sync did not commit: the bases begun in it stay invalid (their pairs' next sync is whole)."""
        self._begun.clear()

    def clear(self) -> None:
        self._bases.clear()
        self._peers.clear()
        self._begun.clear()

    def _drop_unused(self) -> None:
        used = set(self._peers.values())
        for key in [k for k in self._bases if k not in used]:
            del self._bases[key]

    @property
    def nbytes(self) -> int:
        return sum(b[1].numel() for b in self._bases.values())


@dataclass(eq=False, slots=True)
class DeltaMemory:
    """One member's delta state, owned by the caller and handed to the sender or receiver of each new bridge
    (one per member and role): a framework that makes a bridge per update would otherwise never send a
    delta. Nothing in it is trusted more than within one bridge: a base is used only when the other side
    holds the same version of the same cut, and every delta is checked against the source's digest."""

    bases: Bases = field(default_factory=Bases)
    """Every stream's base, one per cut, with the version it holds."""
    buffers: _bytes.BufferCache = field(default_factory=_bytes.BufferCache)
    """A receiver's buffers (its kept copy among them) when it is given no ``buffers=`` of its own."""
    policy: Any = None
    """A sender's :class:`._delta_sync.Policy` (what it measured of the link), kept even where no base is: a
    bridge per update would otherwise never get past its warm-up."""

    def clear(self) -> None:
        """Forget every base: the next sync of each stream is a full one."""
        self.bases.clear()
        self.buffers.clear()
        self.policy = None
