"""The handshake every weight sync starts with, shared by sender and receivers.

1. The sender broadcasts a header (version, manifest digest, bucket size, transport, checksum flag).
2. Every member reports whether it holds the manifest with that digest; if one does not, the sender
   broadcasts the manifest itself (so it travels once, and again only when it changes).
3. Every receiver checks the manifest against what it expects and the version against what it holds, and
   all members gather the verdicts: one problem anywhere and every member raises the same error, before any
   tensor byte moves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestMismatchError, TransportUnavailableError, WeightSyncError
from ..stateless import StatelessGroup
from .manifest import Manifest
from .plan import Plan

__all__ = ["MERGED_BYTES", "Header", "Renamer", "make_renamer", "merged_plan", "refuse", "settle"]

MERGED_BYTES = 1 << 30
"""When every member's tensors lie in the plan's byte layout (both sides ``flatten_``-ed) and the transport is
the group's broadcast, nothing is packed whatever the cut, and fewer, bigger operations are faster (each gloo
operation costs a handshake): all members then cut the stream at this size instead of ``bucket_bytes``."""


def merged_plan(manifest: Manifest) -> Plan:
    return Plan.build(manifest, MERGED_BYTES, MERGED_BYTES)


Renamer = Callable[[str], str]


def make_renamer(rename: Callable[[str], str] | Mapping[str, str] | None) -> Renamer:
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda name: table.get(name, name)
    if callable(rename):
        return rename
    raise TypeError(f"rename= must be a callable or a mapping, got {type(rename).__name__}")


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    digest: str
    bucket_bytes: int
    solo_bytes: int
    transport: str
    checksum: bool
    total_bytes: int
    options: dict[str, Any]
    """Transport options: sync_id, and for relay the chain and chunk size."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "digest": self.digest,
            "bucket_bytes": self.bucket_bytes,
            "solo_bytes": self.solo_bytes,
            "transport": self.transport,
            "checksum": self.checksum,
            "total_bytes": self.total_bytes,
            "options": self.options,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Header:
        return cls(
            int(d["version"]),
            str(d["digest"]),
            int(d["bucket_bytes"]),
            int(d["solo_bytes"]),
            str(d["transport"]),
            bool(d["checksum"]),
            int(d["total_bytes"]),
            dict(d["options"]),
        )


def settle(
    group: StatelessGroup,
    src: int,
    header: Header | None,
    manifest: Manifest | None,
    known: dict[str, Manifest],
    check: Callable[[Header, Manifest], dict[str, Any] | None] | None,
    in_place: Callable[[Header, Manifest], bool] | None = None,
) -> tuple[Header, Manifest, bool]:
    """Run steps 1-3 above; the sender passes ``header`` and ``manifest``, receivers ``check``.

    Every member also says whether its tensors lie in the plan's byte layout (``in_place``); the third
    value returned is True when all do, so that all may use the merged plan (see :data:`MERGED_BYTES`).

    Raises:
        ManifestMismatchError: some receiver's expectations differ (message lists every receiver's problems).
        WeightSyncError: some receiver refused the version.
    """
    wire = group.broadcast_obj(header.to_wire() if header is not None else None, src=src)
    if "error" in wire:
        raise TransportUnavailableError(f"rank {src} cannot send: {wire['error']}")
    header = Header.from_wire(wire)
    have = group.all_gather_obj(manifest is not None or header.digest in known)
    if not all(have):
        items = group.broadcast_obj(manifest.to_wire() if manifest is not None else None, src=src)
        if manifest is None:
            manifest = Manifest.from_wire(items)
            if manifest.digest != header.digest:
                raise WeightSyncError(f"manifest digest {manifest.digest[:12]} does not match the header's")
    if manifest is None:
        manifest = known[header.digest]
    known.clear()
    known[header.digest] = manifest
    verdict = check(header, manifest) if check is not None else None
    flat = verdict is None and in_place is not None and in_place(header, manifest)
    gathered = group.all_gather_obj({"problem": verdict, "in_place": flat})
    verdicts = [g["problem"] for g in gathered]
    problems = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if problems:
        text = "\n".join(f"rank {r}: {v['message']}" for r, v in problems)
        kind = ManifestMismatchError if any(v["kind"] == "manifest" for _, v in problems) else WeightSyncError
        raise kind(f"weight sync of version {header.version} refused before any bytes moved:\n{text}")
    return header, manifest, header.transport == "broadcast" and all(g["in_place"] for g in gathered)


def refuse(group: StatelessGroup, reason: str) -> None:
    """The sender cannot make this sync: tell every receiver why instead of leaving them waiting."""
    group.broadcast_obj({"error": reason}, src=group.rank)
