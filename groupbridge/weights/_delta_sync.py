"""The delta-sync session shared by sender and receivers: what is announced, what travels, what is kept.

A stream travels as a delta when its source offered a base version and its receivers (a fan-out's every one,
a pair's one) said in the handshake (:func:`._session.open_session`) that they hold it:

1. The source diffs each bucket against its copy of the base (:func:`diff`), bringing that copy up to the
   new version, and announces a :class:`Description` (:func:`announce`): a fan-out stream per group of
   buckets (:data:`GROUPS`; the next group is diffed while this one travels), a pair once for all its
   buckets (see ``_streams.parts_of``).
2. The payloads travel as a plan of their own (:func:`wire_plan`), one wire bucket per changed bucket.
3. Every receiver checks each payload's digest, applies it to its copy of the base and checks the result
   against the sender's digest (:class:`Applied`): a receiver that did not hold exactly the base (or applied
   it wrongly) raises instead of holding a silently different model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ProtocolError
from . import _delta, _digests
from ._delta import Code
from .plan import Plan

if TYPE_CHECKING:
    from ..control import Deadline
    from ..stateless import StatelessGroup
    from ._header import Header


@dataclass(frozen=True, slots=True)
class Description:
    codes: tuple[Code, ...]
    counts: tuple[int, ...]
    digests: tuple[Any, ...]
    """Digest of every bucket's new bytes (the version after the sync)."""
    wire_digests: tuple[Any, ...]
    """Digest of every wire bucket's payload, in wire order."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "codes": [int(c) for c in self.codes],
            "counts": list(self.counts),
            "digests": list(self.digests),
            "wire": list(self.wire_digests),
        }

    @classmethod
    def from_wire(cls, d: Any, words: list[int]) -> Description:
        """Parse, checked against its buckets' word counts ``words``; ProtocolError if malformed."""
        if not isinstance(d, dict):
            raise ProtocolError(f"delta description is a {type(d).__name__}, not a dict")
        keys = ("codes", "counts", "digests", "wire")
        lists: list[Any] = [d.get(k) for k in keys]
        codes, counts, digests, wire = lists
        for key, v in zip(keys, lists, strict=True):
            if not isinstance(v, list):
                raise ProtocolError(f"delta description field {key!r} is missing")
        n = len(words)
        if len(codes) != n or len(counts) != n or len(digests) != n:
            raise ProtocolError(f"delta description does not describe the plan's {n} buckets")
        valid = {int(c) for c in Code}
        for k in range(n):
            c, m = codes[k], counts[k]
            if type(c) is not int or c not in valid or type(m) is not int or not 0 <= m <= words[k]:
                raise ProtocolError(f"delta description of bucket {k} is malformed")
        parsed = tuple(Code(c) for c in codes)
        if len(wire) != sum(1 for c in parsed if c is not Code.SAME):
            raise ProtocolError("delta description's payload digests do not match its buckets")
        if not all(isinstance(digest, (int, bytes)) for digest in (*digests, *wire)):
            raise ProtocolError("delta description holds a malformed digest")
        return cls(parsed, tuple(counts), tuple(digests), tuple(wire))


DELTA_TAG = "weights-delta"


def announce(group: StatelessGroup, desc: Description, to: int | None, deadline: Deadline) -> None:
    """Tell a delta stream's receivers its next buckets' diffs, before their payloads: broadcast to a
    fan-out's (``to`` None), or sent to a pair's one on its own tag (never mixed with the caller's)."""
    if to is None:
        group.broadcast_obj(desc.to_wire(), src=group.rank, timeout=deadline)
    else:
        group.send_obj(desc.to_wire(), to, tag=DELTA_TAG)


def announced(
    group: StatelessGroup, src: int, fanout: bool, words: list[int], deadline: Deadline
) -> Description:
    """What :func:`announce` told of ``src``'s next buckets, checked by :meth:`Description.from_wire`."""
    if fanout:
        wire = group.broadcast_obj(None, src=src, timeout=deadline)
    else:
        wire = group.recv_obj(src, timeout=deadline, tag=DELTA_TAG)
    return Description.from_wire(wire, words)


@dataclass(frozen=True, slots=True)
class Diffed:
    """One bucket's diff against the base (which it brought up to the new version)."""

    enc: _delta.Encoded
    digest: Any
    """Digest of the bucket's new bytes."""
    wire_digest: Any | None
    """Digest of what travels for it (None: nothing does)."""

    def payload(self, base: torch.Tensor) -> torch.Tensor | None:
        """What travels for it: the encoding's payload, the base's bucket itself (dense), or None."""
        if self.enc.payload is not None:
            return self.enc.payload
        return base if self.enc.code is Code.DENSE else None


def diff(
    new: torch.Tensor, old: torch.Tensor, word: int, mask: torch.Tensor, kind: str, group: Any
) -> Diffed:
    """Diff bucket ``new`` against the base's ``old``, bringing ``old`` up to ``new``; digests by ``kind``."""
    enc = _delta.encode(new, old, word, mask)
    digest = _digests.digest(old, kind, group)
    if enc.payload is not None:
        return Diffed(enc, digest, _digests.digest(enc.payload, kind, group))
    return Diffed(enc, digest, digest if enc.code is Code.DENSE else None)


def describe(diffs: list[Diffed]) -> Description:
    """What the receivers are told of these buckets' diffs, before their payloads travel."""
    return Description(
        tuple(d.enc.code for d in diffs),
        tuple(d.enc.count for d in diffs),
        tuple(d.digest for d in diffs),
        tuple(d.wire_digest for d in diffs if d.wire_digest is not None),
    )


class Applied:
    """A receiver's end of one delta stream (``desc``: buckets ``first`` on of ``cut``; word ``sizes`` by
    bucket). An unchanged bucket is checked where it lies (``base(k)``, the version held) against the
    source's digest of the new one; a changed one's payload is checked, applied there on ``run`` (a copy
    thread), checked again and written back by ``put(k, view)`` where the base lies elsewhere. Either is then
    handed to ``land(k, view, keys)`` (keys: the tensors whose bytes changed); a mismatch is returned instead
    (this receiver's vote: the rest is taken, not applied)."""

    def __init__(
        self, desc: Description, cut: Plan[Any], sizes: list[int], kind: str, group: Any,
        run: Callable[[Callable[[], torch.Tensor]], torch.Tensor], what: Callable[[int], str], *,
        base: Callable[[int], torch.Tensor], land: Callable[[int, torch.Tensor, set[Any]], None],
        put: Callable[[int, torch.Tensor], None] | None = None, first: int = 0,
    ) -> None:  # fmt: skip
        self.desc, self.cut, self.sizes, self.kind, self.group = desc, cut, sizes, kind, group
        self.run, self.what, self.base, self.land, self.put, self.first = run, what, base, land, put, first

    def _check(self, view: torch.Tensor, k: int) -> str | None:
        """Why ``view`` (bucket ``k`` after its delta, or unchanged by it) is not the sender's new version."""
        if _digests.digest(view, self.kind, self.group) == self.desc.digests[k - self.first]:
            return None
        return (
            f"{self.what(k)} does not match the sender's new version after the delta: this receiver's copy "
            "of the version it held differs from the sender's"
        )

    def unchanged(self, k: int) -> str | None:
        view = self.base(k)
        if (problem := self._check(view, k)) is None:
            self.land(k, view, set())
        return problem

    def changed(self, k: int, j: int, payload: torch.Tensor) -> str | None:
        """Apply wire bucket ``j`` (``payload``) to bucket ``k``."""
        view, w, i = self.base(k), self.sizes[k], k - self.first
        if _digests.digest(payload, self.kind, self.group) != self.desc.wire_digests[j]:
            return f"the delta of {self.what(k)} arrived corrupted (its {self.kind} does not match)"
        moved = self.run(partial(_delta.apply, view, payload, self.desc.codes[i], self.desc.counts[i], w))
        if (problem := self._check(view, k)) is not None:
            return problem
        if self.put is not None:
            self.put(k, view)
        parts = self.cut.buckets[k]
        hit = _delta.spans_hit(moved, [(p.bucket_offset, p.nbytes) for p in parts], w) if parts else []
        self.land(k, view, {p.key for p, h in zip(parts, hit, strict=True) if h})
        return None


GROUPS = 8
"""A fan-out delta travels in about this many groups of buckets, each described and sent as soon as it is
diffed: the sender's diff of the next group overlaps the transfer (and the receivers' apply) of this one."""


def delta_groups(plan: Plan) -> list[tuple[int, int]]:
    """The groups of buckets [a, b) a delta is sent in (both sides compute them from the plan)."""
    step = max(plan.bucket_bytes, plan.total_bytes // GROUPS)
    groups: list[tuple[int, int]] = []
    a = 0
    for k, (_, end) in enumerate(plan.bounds):
        if end - plan.bounds[a][0] >= step or k == len(plan.bounds) - 1:
            groups.append((a, k + 1))
            a = k + 1
    return groups


def delta_digest(header: Header) -> str:
    """How a delta is verified: as the sync's header says, and with XXH3-64 where it says nothing (a delta
    is always checked: a receiver whose copy differs from the sender's must not hold a third model)."""
    return str(header.verify) or "xxh3"


def wire_plan(desc: Description, sizes: list[int], words: list[int]) -> tuple[Plan, list[int]]:
    """The plan the payloads travel by, and for each wire bucket the bucket of the model plan it updates."""
    sources = [k for k, code in enumerate(desc.codes) if code is not Code.SAME]
    nbytes = [_delta.payload_nbytes(desc.codes[k], desc.counts[k], words[k], sizes[k]) for k in sources]
    return Plan.of_sizes(nbytes), sources


class Policy:
    """Whether diffing pays on this link: the sender's choice, per sync, between a delta and a full sync.

    A delta costs a pass over the model on every member (compare, encode, apply, digest) plus the changed
    bytes on the wire; a full sync, the model's bytes on the wire: over a slow link the delta is far cheaper,
    over loopback or shared memory the wire can beat the diff itself. The policy predicts both per model byte
    and takes the delta under ``margin`` of a full sync: a full sync costs what the last one measured; a
    delta, the diff's measured speed (a slice of one bucket diffed during full syncs, a synthetic one before
    the first) times a factor learnt from the deltas made, plus its encoded bytes at the full sync's speed.

    The first sync is always a full one, and cold (buffers touched for the first time, transports set up):
    its time overstates the link's cost, so the policy decides from the second full sync on. A fast link
    never pays for a probe; a slow one switches to deltas at its third. Where the source chose deltas, each of
    its streams then goes by what changed in its own cut (:meth:`pays`).
    """

    WARM_FULL_SYNCS = 2
    REFRESH = 8

    SAMPLE_BYTES = 8 << 20
    """The slice of one bucket diffed during a full sync to measure the diff (about 1% of a sync here)."""

    def __init__(self, *, always: bool = False, margin: float = 0.8) -> None:
        self.always = always
        self.margin = margin
        self.full_spb: float | None = None
        """Seconds per model byte of the last full sync."""
        self.diff_spb: float | None = None
        """Seconds per byte of diffing one bucket on one thread."""
        self.changed = 0.05
        """Fraction of words changed, last seen (a guess until a sample or a delta says)."""
        self.wire = 0.15
        """A delta's bytes on the wire over the model's, last seen (the sample's encoding, or a delta's)."""
        self.factor = 1.5
        """A delta sync's time over its diff time alone, learnt from the deltas made."""
        self.full_syncs = 0
        self.chose_delta = False
        self._full_run = 0
        self.syncs = 0
        self.streams: dict[str, tuple[float, int]] = {}
        """By a stream's cut: its own wire share (its delta's bytes over its cut's) and the sync that measured
        it. A source's streams share its link and its diff, not what changed: where one cut changes whole
        (its delta costs the diff and all its bytes) and another barely, each goes its own way."""

    def wants_delta(self) -> bool:
        self.chose_delta = self._wants_delta()
        return self.chose_delta

    def _wants_delta(self) -> bool:
        if self.always:
            return True
        if self.full_syncs < self.WARM_FULL_SYNCS or self.full_spb is None:
            return False
        if self.diff_spb is None:
            self.diff_spb = _calibrate()
        predicted = self.diff_spb * self.factor + self.wire * self.full_spb
        return predicted < self.margin * self.full_spb

    def pays(self, key: str) -> bool:
        """Whether the stream of cut ``key`` travels as a delta in a sync whose source chose deltas: by its
        own wire share where a delta of it measured one in the last :data:`REFRESH` syncs (older, it tries
        again), else as the source's other streams."""
        seen = self.streams.get(key)
        if self.always or seen is None or self.syncs - seen[1] >= self.REFRESH:
            return True
        if self.diff_spb is None or self.full_spb is None:
            return True
        return self.diff_spb * self.factor + seen[0] * self.full_spb < self.margin * self.full_spb

    def record_stream(self, key: str, wire_bytes: int, nbytes: int) -> None:
        """A delta of the stream of cut ``key`` moved ``wire_bytes`` of its ``nbytes``."""
        self.streams[key] = (wire_bytes / max(nbytes, 1), self.syncs)

    def keep_base(self) -> bool:
        """Whether this full sync refreshes the sender's base. Packing into the base costs nothing over the
        network, but a copy more into shared memory (or from a ``flatten_``-ed model): while full syncs win,
        the base is refreshed on two syncs in a row out of every :data:`REFRESH` (the second samples the
        diff), so the policy keeps measuring at a fraction of the cost."""
        self._full_run = 0 if self.chose_delta else self._full_run + 1
        if self.always or self.chose_delta or self.full_syncs < self.WARM_FULL_SYNCS:
            return True
        return self._full_run % self.REFRESH in (0, self.REFRESH - 1)

    def record_full(self, seconds: float, model_bytes: int) -> None:
        self.full_spb = seconds / max(model_bytes, 1)
        self.full_syncs += 1
        self.syncs += 1

    def record_sample(self, seconds: float, nbytes: int, changed: float, wire_bytes: int) -> None:
        self.diff_spb = seconds / max(nbytes, 1)
        self.changed = changed
        self.wire = wire_bytes / max(nbytes, 1)

    def record_delta(self, seconds: float, model_bytes: int, wire_bytes: int, changed: float) -> None:
        self.syncs += 1
        self.changed = changed
        self.wire = wire_bytes / max(model_bytes, 1)
        if self.diff_spb is not None and self.full_spb is not None:
            wire = wire_bytes * self.full_spb
            self.factor = max(0.5, (seconds - wire) / max(model_bytes, 1) / self.diff_spb)


def _calibrate() -> float:
    """Seconds per byte of diffing here, on synthetic bf16 words with 5% changed (about 10 ms)."""
    g = torch.Generator().manual_seed(0)
    words = Policy.SAMPLE_BYTES // 2
    base = torch.randint(-(2**15), 2**15, (words,), dtype=torch.int16, generator=g)
    new = base.clone()
    new[torch.randint(0, words, (words // 20,), generator=g)] ^= 1
    t0 = time.perf_counter()
    _delta.encode(new.view(torch.uint8), base.view(torch.uint8), 2)
    return (time.perf_counter() - t0) / Policy.SAMPLE_BYTES
