"""The handshake every weight sync starts with, shared by sender and receivers.

1. The sender broadcasts a header (version, manifest digest, bucket size, transport, checksum flag).
2. Every member reports whether it holds the manifest with that digest; if one does not, the sender
   broadcasts the manifest itself (so it travels once, and again only when it changes).
3. Every receiver checks the manifest against what it expects and the version against what it holds, and
   all members gather the verdicts: one problem anywhere and every member raises the same error, before any
   tensor byte moves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..control import Deadline
from ..errors import (
    ManifestMismatchError,
    ProtocolError,
    SyncRefusedError,
    TransportUnavailableError,
    WeightSyncError,
)
from ..stateless import StatelessGroup
from . import _bytes
from .manifest import Manifest
from .plan import Plan
from .transports import TRANSPORTS

__all__ = [
    "ACK_TAG",
    "MERGED_BYTES",
    "Header",
    "Renamer",
    "Settled",
    "laid_out_in_place",
    "make_renamer",
    "merged_plan",
    "refuse",
    "settle",
]

ACK_TAG = "weights-ack"
"""Receivers' acknowledgements travel on their own tag, never mixing with the caller's objects."""

MERGED_BYTES = 1 << 30
"""When every member's tensors lie in the plan's byte layout (both sides ``flatten_``-ed) and the transport
can cut the stream anywhere (``TransportSpec.cut_anywhere``: the group's broadcast), nothing is packed
whatever the cut, and fewer, bigger operations are faster (each gloo operation costs a handshake): all
members then cut the stream at this size instead of ``bucket_bytes``."""


def merged_plan(manifest: Manifest) -> Plan:
    return Plan.build(manifest, MERGED_BYTES, MERGED_BYTES)


def laid_out_in_place(manifest: Manifest, tensors: list[torch.Tensor | None], *, receiving: bool) -> bool:
    """Whether ``tensors`` (in manifest order) lie in the merged plan's byte layout, so that every bucket of
    any cut is a view of their own storage (see :func:`._bytes.in_place_bucket`)."""
    plan = merged_plan(manifest)
    return all(
        _bytes.in_place_bucket(plan, k, tensors, receiving=receiving) is not None
        for k in range(len(plan.buckets))
    )


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


VERIFY = ("", "crc32", "xxh3", "hmac")
_SYNC_ID = re.compile(r"[0-9a-f]{1,64}")
MAX_BUCKET_BYTES = 1 << 40


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    digest: str
    bucket_bytes: int
    solo_bytes: int
    transport: str
    verify: str
    """How receivers check the bytes before accepting them: "" (not at all), "xxh3" or "crc32", or "hmac"
    (always with a token: keyed from it, so bytes injected by anyone else are refused)."""
    total_bytes: int
    options: dict[str, Any]
    """``sync_id`` (names this sync's control keys) and ``transport``: the transport's own options."""

    @property
    def sync_id(self) -> str:
        return str(self.options["sync_id"])

    @property
    def transport_options(self) -> dict[str, Any]:
        return dict(self.options["transport"])

    @property
    def delta(self) -> bool:
        """The sender keeps a base: receivers keep the version they get so that later syncs can be deltas."""
        return "delta" in self.options

    @property
    def base(self) -> int | None:
        """The version this sync is a delta against, when the sender offers one."""
        d = self.options.get("delta")
        return d.get("base") if isinstance(d, dict) else None

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "digest": self.digest,
            "bucket_bytes": self.bucket_bytes,
            "solo_bytes": self.solo_bytes,
            "transport": self.transport,
            "verify": self.verify,
            "total_bytes": self.total_bytes,
            "options": self.options,
        }

    @classmethod
    def from_wire(cls, d: Any) -> Header:
        """Parse a header from the wire; anything malformed is a :class:`ProtocolError`."""
        if not isinstance(d, dict):
            raise ProtocolError(f"sync header is a {type(d).__name__}, not a dict")

        def field(name: str, kind: type, lo: int = 0, hi: int = 1 << 62) -> Any:
            v: Any = d.get(name)
            if type(v) is not kind or (isinstance(v, int) and not lo <= v <= hi):
                raise ProtocolError(f"sync header field {name!r} is missing, mistyped or out of range")
            return v

        verify = field("verify", str)
        if verify not in VERIFY:
            raise ProtocolError(f"sync header: unknown verification {verify!r}")
        options = field("options", dict)
        sid = options.get("sync_id")
        if not isinstance(sid, str) or not _SYNC_ID.fullmatch(sid):
            raise ProtocolError("sync header: 'sync_id' is missing or malformed")
        if not isinstance(options.get("transport"), dict):
            raise ProtocolError("sync header: the transport's options are missing")
        if "delta" in options:
            delta = options["delta"]
            base = delta.get("base") if isinstance(delta, dict) else 0
            if base is not None and type(base) is not int:
                raise ProtocolError("sync header: the delta's base version is malformed")
        return cls(
            field("version", int, -(1 << 62)),
            field("digest", str),
            field("bucket_bytes", int, 1, MAX_BUCKET_BYTES),
            field("solo_bytes", int, 1, MAX_BUCKET_BYTES),
            field("transport", str),
            verify,
            field("total_bytes", int),
            options,
        )


def settle(
    group: StatelessGroup,
    src: int,
    header: Header | None,
    manifest: Manifest | None,
    known: dict[str, Manifest],
    check: Callable[[Header, Manifest], dict[str, Any] | None] | None,
    in_place: Callable[[Header, Manifest], bool] | None,
    deadline: Deadline,
    has_base: Callable[[Header, Manifest], bool] | None = None,
) -> Settled:
    """Run steps 1-3 above; the sender passes ``header`` and ``manifest``, receivers ``check``.

    Every member also says whether its tensors lie in the plan's byte layout (``in_place``): ``merged`` is
    True when all do, so that all may use the merged plan (see :data:`MERGED_BYTES`); and, when the header
    offers a delta, whether it holds the base version (``has_base``): ``delta`` is True when every receiver
    does.

    Raises:
        ManifestMismatchError: some receiver's expectations differ (message lists every receiver's problems).
        WeightSyncError: some receiver refused the version.
    """
    wire = group.broadcast_obj(header.to_wire() if header is not None else None, src=src, timeout=deadline)
    if isinstance(wire, dict) and "error" in wire:
        kind = TransportUnavailableError if wire.get("kind") == "transport" else WeightSyncError
        raise kind(f"rank {src} refused to send: {str(wire['error'])[:4000]}")
    header = Header.from_wire(wire)
    have = group.all_gather_obj(manifest is not None or header.digest in known, timeout=deadline)
    if not all(have):
        items = group.broadcast_obj(
            manifest.to_wire() if manifest is not None else None, src=src, timeout=deadline
        )
        if manifest is None:
            manifest = Manifest.from_wire(items)
            if manifest.digest != header.digest:
                raise ProtocolError(f"manifest digest {manifest.digest[:12]} does not match the header's")
    if manifest is None:
        manifest = known[header.digest]
    known.clear()
    known[header.digest] = manifest
    verdict = check(header, manifest) if check is not None else None
    flat = verdict is None and in_place is not None and in_place(header, manifest)
    base = verdict is None and header.base is not None and has_base is not None and has_base(header, manifest)
    gathered = group.all_gather_obj({"problem": verdict, "in_place": flat, "base": base}, timeout=deadline)
    for r, g in enumerate(gathered):
        if not (
            isinstance(g, dict)
            and isinstance(g.get("in_place"), bool)
            and isinstance(g.get("base"), bool)
            and (g.get("problem") is None or (
                isinstance(g["problem"], dict)
                and isinstance(g["problem"].get("message"), str)
                and g["problem"].get("kind") in ("stale", "manifest", "other")
            ))
        ):  # fmt: skip
            raise ProtocolError(f"rank {r}'s verdict on the sync is malformed")
    problems = [(r, g["problem"]) for r, g in enumerate(gathered) if g["problem"] is not None]
    if problems:
        text = "\n".join(f"rank {r}: {v['message'][:4000]}" for r, v in problems)
        kind = (
            ManifestMismatchError if any(v["kind"] == "manifest" for _, v in problems) else SyncRefusedError
        )
        raise kind(f"weight sync of version {header.version} refused before any bytes moved:\n{text}")
    merged = _cuts_anywhere(header.transport) and all(g["in_place"] for g in gathered)
    delta = header.base is not None and all(g["base"] for r, g in enumerate(gathered) if r != src)
    return Settled(header, manifest, merged, delta)


class Settled(NamedTuple):
    """The outcome of the handshake, the same on every member."""

    header: Header
    manifest: Manifest
    merged: bool
    delta: bool


def refuse(group: StatelessGroup, reason: str, deadline: Deadline, kind: str = "input") -> None:
    """The sender cannot make this sync: tell every receiver why instead of leaving them waiting."""
    group.broadcast_obj({"error": reason, "kind": kind}, src=group.rank, timeout=deadline)


def _cuts_anywhere(kind: str) -> bool:
    spec = TRANSPORTS.get(kind)  # an unknown transport is refused when the receiver sets it up
    return spec is not None and spec.cut_anywhere
