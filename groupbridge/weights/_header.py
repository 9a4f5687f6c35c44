"""What a sync's members tell each other in its handshake: each source's :class:`Header` (what it sends and
how) and each receiver's :class:`Verdict` (whether it takes it), both parsed from the wire as hostile."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ProtocolError

VERIFY = ("", "xxh3", "blake3", "mix64")
_SYNC_ID = re.compile(r"[0-9a-f]{1,64}")
MAX_BUCKET_BYTES = 1 << 40
MAX_VERSION = (1 << 62) - 1
"""The largest version a sync carries (and the smallest, negated): every version that enters (a send, a
trainer's next version, an engine's update) is checked against it, so that the version an engine then
holds always has a next one that is valid, and every verdict can carry it back."""


def check_version(version: Any, what: str = "version") -> int:
    """``version`` if it is an int within +-:data:`MAX_VERSION`; else TypeError or ValueError saying so."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"{what} must be an int, got {type(version).__name__}")
    if not -MAX_VERSION <= version <= MAX_VERSION:
        raise ValueError(f"{what}={version} is out of range: versions lie within +-(2**62 - 1)")
    return version


MAX_OFFER_ITEMS = 64


@dataclass(frozen=True, slots=True)
class Header:
    """What a source announces about its stream of a sync (sealed with the group's token, if any)."""

    version: int
    digest: str
    """The manifest's digest: receivers that know it need not be sent the manifest again."""
    bucket_bytes: int
    solo_bytes: int
    transport: str
    verify: str
    """How receivers check the bytes before accepting them (``_digests.digest``): "" (not at all), "xxh3"
    (XXH3-64 on the host), "mix64" (a checksum computed on the bucket's device, ``_device_digest``), or
    "blake3" (keyed BLAKE3, only with a token, keyed from it: bytes injected by anyone else are refused)."""
    total_bytes: int
    sync_id: str
    """Names this sync's control keys (fresh per sync: a signal of one sync never passes for another's)."""
    transport_options: dict[str, Any]
    """The transport's own options, parsed by its :class:`TransportSpec` on each receiver."""
    offer: dict[str, Any]
    """What receivers need to attach to the transport (shared slots to map), see ``TxTransport.offer``."""
    keeps_base: bool = False
    """The source keeps a base (``WeightSender(delta=True)``): receivers keep this version as theirs."""
    base: int | None = None
    """The version this sync would be a delta against, when the source offers one."""
    pair_deltas: bool = False
    """Many sources: this source's delta policy wants its pairs sent as deltas this sync (where its receiver
    holds the same base); else they travel whole, and the bases are refreshed."""
    bucket_cap: int = 0
    """Many sources: the most bytes one of this source's buckets may hold (``plan_shards``'s ``caps``)."""
    forward: bool = True
    """Many sources: receivers may forward its cut (``WeightSender(forward=...)``; see ``plan_shards``)."""

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

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
        if not _SYNC_ID.fullmatch(field("sync_id", str)):
            raise ProtocolError("sync header: 'sync_id' is malformed")
        if len(field("offer", dict)) > MAX_OFFER_ITEMS:
            raise ProtocolError("sync header: the transport's offer is too large")
        base = d.get("base")
        if base is not None and type(base) is not int:
            raise ProtocolError("sync header: the delta's base version is malformed")
        return cls(
            field("version", int, -MAX_VERSION, MAX_VERSION),
            field("digest", str),
            field("bucket_bytes", int, 1, MAX_BUCKET_BYTES),
            field("solo_bytes", int, 1, MAX_BUCKET_BYTES),
            field("transport", str),
            verify,
            field("total_bytes", int),
            d["sync_id"],
            field("transport_options", dict),
            d["offer"],
            field("keeps_base", bool),
            base,
            field("pair_deltas", bool),
            field("bucket_cap", int, 0, MAX_BUCKET_BYTES),
            field("forward", bool),
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """A receiver's answer to a header, gathered by every member."""

    problem: str | None = None
    """Why this receiver cannot take the sync, or None."""
    kind: str = "other"
    """``stale`` (not a newer version), ``manifest`` (other tensors than expected), ``transport`` (cannot
    attach), ``size`` (more than the receiver may allocate) or ``other``."""
    in_place: bool = False
    """Its tensors lie in the plan's byte layout (see :data:`.plan.MERGED_BYTES`)."""
    base: bool = False
    """It holds the version the header offers a delta against."""
    held: tuple[tuple[int, int], ...] = ()
    """Many sources: (peer, version) of every pair base this member holds for the sync's cut."""
    holds: int | None = None
    """With a ``stale`` problem: the version this receiver holds."""
    fan: int = 0
    """Many sources: how many receivers this source posts to itself (0 for a receiver)."""

    KINDS = ("stale", "manifest", "transport", "size", "other")

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"problem": self.problem, "kind": self.kind, "in_place": self.in_place,
                                "base": self.base}  # fmt: skip
        if self.held:
            wire["held"] = [list(h) for h in self.held]
        if self.holds is not None:
            wire["holds"] = self.holds
        if self.fan:
            wire["fan"] = self.fan
        return wire

    @classmethod
    def from_wire(cls, d: Any, rank: int) -> Verdict:
        if not (
            isinstance(d, dict)
            and isinstance(d.get("in_place"), bool)
            and isinstance(d.get("base"), bool)
            and d.get("kind") in cls.KINDS
            and (d.get("problem") is None or isinstance(d["problem"], str))
            and isinstance(held := d.get("held", []), list)
            and all(isinstance(h, list) and len(h) == 2 and all(type(x) is int for x in h) for h in held)
            and (
                (holds := d.get("holds")) is None
                or (type(holds) is int and -MAX_VERSION <= holds <= MAX_VERSION)
            )
            and type(fan := d.get("fan", 0)) is int
            and 0 <= fan < 1 << 31
        ):
            raise ProtocolError(f"rank {rank}'s verdict on the sync is malformed")
        held_pairs = tuple((h[0], h[1]) for h in held)
        return cls(d["problem"], d["kind"], d["in_place"], d["base"], held_pairs, holds, fan)
