"""What a member remembers of the handshake's posts, so that a repeat sync costs a digest.

A handshake post has two kinds of fields: what changes every sync (the version, the sync's id, the delta
offer: :data:`DYNAMIC`) and what describes the member's layout and stays put while the training loop runs
(the rest of its header, its manifest, the boxes it holds or wants: :data:`STICKY`). A member posts its
layout's digest every sync, and the layout itself only when that digest is not the one this handle posted
last; every member keeps the last few layouts each member posted, by digest, and reads an unchanged one from
there. The gather sends each field on its own (``all_gather_obj(by_field=True)``), so a layout that many
members post alike (one manifest, a replica's wants) travels and is decoded once.

Every member of a group reads every post of every sync it takes part in, so a digest always names a layout
that every member holds: the layouts are kept on the group (``StatelessGroup.memory``), whichever handle
(a new receiver on an old group) reads them. One that a member does not hold (it cannot happen short of a
bug) is refused by name, never guessed.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .. import codec
from ..errors import ProtocolError
from ..stateless import StatelessGroup
from .manifest import Manifest

DYNAMIC = ("version", "sync_id", "keeps_base", "base", "pair_deltas")
"""The header's fields that change every sync; the others travel with the layout."""
STICKY = ("hs", "manifest", "boxes", "rule", "at", "none", "wants", "wants_if")
"""A post's fields that travel only when they changed: the header's other fields, the manifest, the boxes
held (listed, or a rule and the place in it, and the tensors held none of: see :mod:`._rules`) and the boxes
wanted (and on which condition)."""
KEPT = 4
"""Layouts kept per member (a member may post through a sender and a receiver, each with its own memory)."""
KNOWN_MANIFESTS = 16
"""Manifests a member keeps decoded, by digest."""


class Posts:
    """One handle's memory of the handshake (a :class:`~.sender.WeightSender`'s or a receiver's): what it
    posted last, every member's recent layouts, and the manifests it decoded."""

    def __init__(self, group: StatelessGroup) -> None:
        self.known: dict[str, Manifest] = {}
        """Decoded manifests by digest, least recently used first."""
        self._mine: str | None = None
        self._whole: dict[str, Any] = {}
        self._last: tuple[dict[str, Any] | None, str] = (None, "")
        """The layout posted last and its digest."""
        self._theirs: dict[int, dict[str, dict[str, Any]]] = group.memory.setdefault("weights.layouts", {})

    def post(self, dynamic: dict[str, Any], sticky: dict[str, Any]) -> dict[str, Any]:
        """This member's post: ``dynamic`` and its layout's digest, with the layout (``sticky``, marked
        ``new``) when it is not the one posted last."""
        if sticky != self._last[0]:  # comparing is cheaper than encoding, and a layout rarely changes
            self._last = sticky, hashlib.sha256(codec.encode(sticky)).hexdigest()[:32]
        digest = self._last[1]
        out = {**dynamic, "g": digest}
        self._whole = {**out, **sticky, "new": True}
        if digest != self._mine:
            out.update(sticky, new=True)
        return out

    def posted(self, post: dict[str, Any]) -> None:
        """``post`` reached every member (the gather returned): its layout need not travel again."""
        self._mine = post.get("g")

    def read(self, posts: list[Any], me: int) -> list[Any]:
        """Every member's whole post (``me``: this member, whose post is the one :meth:`post` made): an
        unchanged layout taken from memory, a new one kept."""
        out = []
        for rank, p in enumerate(posts):
            if rank == me:
                p = self._whole
            if not isinstance(p, dict) or "g" not in p:  # a refusal, or malformed: checked where it is read
                out.append(p)
                continue
            digest = p["g"]
            if not isinstance(digest, str) or len(digest) != 32:
                raise ProtocolError(f"rank {rank}'s post names its layout by a malformed digest")
            kept = self._theirs.setdefault(rank, {})
            layout = {k: p[k] for k in STICKY if k in p}
            if p.get("new") is True:
                kept.pop(digest, None)
                kept[digest] = layout
                while len(kept) > KEPT:
                    kept.pop(next(iter(kept)))
            elif digest not in kept:
                raise ProtocolError(
                    f"rank {rank} posted its layout by digest {digest}, which this member never received "
                    "(members must take part in every sync of their group)"
                )
            else:  # used again: the most recently used (a sender's and a receiver's layouts take turns)
                kept[digest] = kept.pop(digest)
            out.append({**kept[digest], **{k: v for k, v in p.items() if k not in STICKY and k != "new"}})
        return out

    def forget(self) -> None:
        """Post the whole layout next time (after a sync that may not have reached every member)."""
        self._mine = None

    def remember(self, manifest: Manifest) -> None:
        """Keep ``manifest`` decoded, the least recently used ones dropped."""
        self.known.pop(manifest.digest, None)
        self.known[manifest.digest] = manifest
        while len(self.known) > KNOWN_MANIFESTS:
            self.known.pop(next(iter(self.known)))


def header_fields(header_wire: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A header's wire form split into (what changes every sync, what travels with the layout)."""
    return {k: header_wire[k] for k in DYNAMIC}, {k: v for k, v in header_wire.items() if k not in DYNAMIC}


def header_of(post: dict[str, Any]) -> Any:
    """A source's whole header, as its wire form (to be parsed as hostile)."""
    hs, h = post.get("hs"), post.get("h")
    if not isinstance(hs, dict) or not isinstance(h, dict):
        return None
    return {**hs, **h}
