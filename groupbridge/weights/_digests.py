"""What a bucket's bytes are checked by: a digest per bucket (:func:`digest`), taken by each member as the
buckets pass and compared per stream once the last has landed (:class:`Digests`)."""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from ._device_digest import checksum64

if TYPE_CHECKING:
    from ..control import Deadline
    from ..stateless import StatelessGroup


def digest(buf: torch.Tensor, kind: str, group: StatelessGroup) -> int | bytes:
    """A bucket's digest: ``xxh3`` (XXH3-64: catches corruption), ``mix64`` (the same, computed on the
    bucket's device: see ``_device_digest``) or ``blake3`` (keyed BLAKE3, keyed from the group's token:
    catches forgery too). The host's release the GIL while hashing; their speeds are in docs/results.md."""
    if kind == "mix64":
        return checksum64(buf)
    if buf.device.type != "cpu":
        buf = buf.cpu()
    if kind == "xxh3":
        return xxhash.xxh3_64_intdigest(buf.numpy().data)
    h = group.control.sealer.digest()
    h.update(buf.numpy().data)
    return bytes(h.digest())


DIGEST_TAG = "weights-digests"


class Digests:
    """One member's digests of a sync's buckets (``kind``: see :func:`digest`), one list per stream: a source
    takes one per bucket it posts and, after its last, sends each receiver the list of the stream that
    reached it (:meth:`send`); a receiver takes one per bucket that lands and compares. With no ``kind`` (the
    sender's ``checksum=False``, no token), the streams of ``chained`` (by their key) are digested all the
    same, with ``xxh3``: a receiver down a chain takes bytes a peer passed on, not the source's."""

    def __init__(self, kind: str, group: StatelessGroup, chained: Container[int | None] = ()) -> None:
        self.kind = kind
        self.group = group
        self.chained = chained
        self.taken: dict[int | None, list[int | bytes]] = {}

    def kind_of(self, stream: int | None) -> str:
        return self.kind or ("xxh3" if stream in self.chained else "")

    def take(self, view: torch.Tensor, stream: int | None = None) -> None:
        kind = self.kind_of(stream)
        if kind:
            self.taken.setdefault(stream, []).append(digest(view, kind, self.group))

    def send(self, routes: Iterable[tuple[int, int | None]]) -> None:
        """To each receiver, the digests of the stream that reached it: (receiver, the stream's key: None
        for a fan-out stream, else the receiver the source sent it to, which forwarded it on)."""
        for r, stream in routes:
            if self.kind_of(stream):
                self.group.send_obj(self.taken.get(stream, []), r, tag=DIGEST_TAG)

    def check(self, src: int, deadline: Deadline, via: int | None = None) -> str | None:
        """Compare what landed from ``src`` (passed on by receiver ``via``, if forwarded) with the digests it
        sent; why the bytes are refused, or None."""
        kind = self.kind_of(src)
        if not kind:
            return None
        sent: Any = self.group.recv_obj(src, timeout=deadline, tag=DIGEST_TAG)
        mine = self.taken.get(src, [])
        if not isinstance(sent, list) or len(sent) != len(mine):
            return f"rank {src}'s digests are malformed ({type(sent).__name__}, not {len(mine)} digests)"
        bad = [k for k, (a, b) in enumerate(zip(sent, mine, strict=True)) if a != b]
        if not bad:
            return None
        which = f"{kind} mismatch in bucket(s) {', '.join(map(str, bad[:20]))} of {len(mine)} from rank {src}"
        if via is None or via == src:
            return f"{which}: the bytes that arrived are corrupted, short or were not sent by that member"
        return (
            f"{which}, passed on by rank {via}: corrupted by rank {via} or on its link to this one when rank "
            f"{via}'s own copy matched (its vote says), else on the way from rank {src}"
        )
