"""The plan of a sync with many sources, each member's own share of it, from the boxes (whole tensors or
:class:`~.shard.Shard` boxes) each source holds and each receiver wants, as the handshake told them.

Every member computes only what it takes part in, and every member computes a pair the same way, so the two
ends of a pair agree on every byte without another round:

1. **Checks** every member can make from what everyone posted (every member raises the same
   :class:`ManifestMismatchError`, naming the tensor and the box): holders or receivers that disagree on
   dtype or global shape, a box outside its tensor, a wanted tensor nobody holds. A wanted box that is only
   partly held is found by its receiver alone (``ShardPlan.problems``): its verdict refuses the sync.
2. **Index**: per tensor, the distinct boxes held and wanted, each with the members that hold or want it
   (members that post the same layout are grouped, so sixteen replicas of one tensor-parallel rank are one
   entry), sorted by their first dimension so a box's overlaps are found by bisection, not by a scan.
3. **Pieces**: source ``s`` sends receiver ``r`` the part of ``box(s) & want(r)`` it owns. A point several
   sources hold is owned by one of them, chosen from the tensor's name and ``r``'s layout group: a pure
   function of the point, so both ends agree whatever else they know, and replicas share the work across
   tensors and receivers.
4. **Pairs**: each pair's pieces in tensor order, cut by rows to about a bucket and packed into buckets
   (aligned to :data:`ALIGN`): a :class:`.plan.Plan` per pair. A cut that more receivers want than there are
   sources is chained (see :func:`plan_shards`'s ``forward``).

A member's work grows with what it holds or wants and the boxes that overlap them, not with every member
times every tensor (the index is built from distinct layouts).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codec import dtype_from_name
from ..errors import ManifestMismatchError
from ._rules import Family
from .plan import Plan
from .shard import Box

ALIGN = 16
FORWARD_BYTES = 1 << 20
"""The bucket size of a forwarded cut: each hop passes a bucket on once it landed whole, so a chain adds a
bucket's time per hop (see docs/results.md, "forwarding chains")."""


@dataclass(frozen=True, slots=True)
class Held:
    """One box of one tensor, as a member holds or wants it."""

    name: str
    dtype: str
    """The dtype on the wire."""
    global_shape: tuple[int, ...]
    box: Box


@dataclass(slots=True)
class Piece:
    """A box of tensor ``name`` in a bucket, at ``offset`` bytes (not frozen: a receiver of a sharded model's
    norms makes a hundred thousand of them per plan, and a frozen one costs three times as much to make)."""

    name: str
    box: Box
    offset: int
    nbytes: int

    @property
    def key(self) -> str:
        """The tensor it is a part of (see ``plan.Segment.key``): its name on the wire."""
        return self.name

    @property
    def bucket_offset(self) -> int:
        return self.offset

    def part(
        self, slot: tuple[torch.Tensor, Box], wire: torch.dtype | None = None
    ) -> tuple[int, int, torch.Tensor, torch.dtype]:
        """Its box of ``slot`` (a tensor; the box of the global tensor it holds), travelling as ``wire``
        (default: the tensor's own dtype), as a ``_bytes.Part``."""
        tensor, held = slot
        piece = tensor if self.box == held else tensor[self.box.slices(held.offset)]
        return self.offset, self.nbytes, piece, wire or tensor.dtype


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One member's share of a sync's plan (or every member's, merged, when planned with ``me=None``)."""

    order: tuple[str, ...]
    """Every tensor some receiver wants, in the order the sources list them."""
    dtypes: Mapping[str, str]
    global_shapes: Mapping[str, tuple[int, ...]]
    pairs: Mapping[tuple[int, int], Plan[Piece]]
    """(source, receiver) -> the cut of the stream that pair moves: the pairs this member sends, takes or
    forwards."""
    sent: Mapping[int, int]
    """Bytes each source of these pairs sends over them."""
    replicated: tuple[tuple[str, Box, tuple[int, ...]], ...] = ()
    """(tensor, region, its two holders) of every wanted region this member holds and another source holds
    too: each holder digests the region and the vote compares them, so replicas that disagree are refused
    instead of mixed."""
    upstream: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """Forwarded pairs of the chains this member is in: (source, receiver) -> the receiver that passes the
    pair's buckets on to it (see :func:`plan_shards`'s ``forward``); every other pair comes from its
    source."""
    receivers: tuple[int, ...] = ()
    """Every member that takes something in this sync, in rank order (the turns of a round, see
    :meth:`turn`)."""
    sources: tuple[int, ...] = ()
    problems: tuple[str, ...] = ()
    """What this member found wrong that only it can see (a wanted box partly held): its verdict refuses."""

    def feeder(self, src: int, dst: int) -> int:
        """Who sends pair (src, dst)'s bytes: its source, or the receiver that forwards them."""
        return self.upstream.get((src, dst), src)

    def head(self, src: int, dst: int) -> int:
        """The receiver that takes pair (src, dst)'s bytes from the source itself (``dst``, unforwarded)."""
        while (src, dst) in self.upstream:
            dst = self.upstream[(src, dst)]
        return dst

    def hop(self, src: int, dst: int) -> int:
        """How many receivers the pair's bytes pass before reaching ``dst`` (0: straight from the source)."""
        n = 0
        while (src, dst) in self.upstream:
            dst, n = self.upstream[(src, dst)], n + 1
        return n

    def chain(self, src: int, dst: int) -> list[tuple[int, int]]:
        """Every pair of the chain pair (src, dst) is in (itself alone when it is not forwarded)."""
        head = self.head(src, dst)
        down = {u: d for (s, d), u in self.upstream.items() if s == src}
        out, at = [(src, head)], head
        while at in down:
            at = down[at]
            out.append((src, at))
        return out

    def turn(self, src: int, dst: int) -> int:
        """The pair's turn in a round of pair streams, ``(receiver's index - source's index) mod receivers``:
        each turn, every source sends to another receiver, so every link is busy. Every member walks its
        pairs by (round, turn, source), one total order, so no stream waits on another in a cycle."""
        at = bisect.bisect_left(self.receivers, dst)
        return (at - bisect.bisect_left(self.sources, src)) % max(len(self.receivers), 1)

    def cut(self, src: int, dst: int) -> Plan[Piece]:
        return self.pairs.get((src, dst)) or Plan.of_sizes([])


def element_size(dtype: str) -> int:
    return dtype_from_name(dtype).itemsize


def plan_shards(
    held: Mapping[int, Sequence[Held]],
    wanted: Mapping[int, Sequence[Held]],
    bucket_bytes: int,
    caps: Mapping[int, int] | None = None,
    forward: frozenset[int] = frozenset(),
    me: int | None = None,
    families: Sequence[Family] = (),
    order: Sequence[str] | None = None,
) -> ShardPlan:
    """Member ``me``'s share of the plan (see the module's docstring; ``None``: every member's, merged, for
    tests and tools, raising on what only one member finds too). Members that hold or want the very same
    list (one object) are planned as one group, so pass one list per layout, not a copy per member.
    ManifestMismatchError lists every problem every member finds alike.

    ``caps``: per source, the most bytes one of its buckets may hold (0 or absent: ``bucket_bytes``), as its
    transport reserved before the plan was known; only the plan can keep to it (pieces are aligned, and a
    region several sources hold may be several pieces).

    ``forward``: the sources whose pairs may be forwarded (pairs across hosts, point to point). Where more
    receivers want one such source's cut than there are sources, sending it to each would load its link
    once per receiver while theirs idle: it goes to one, and each passes every bucket on to the next as it
    lands (a chain started at a receiver rotated by source, so each forwards about as much as it takes), in
    buckets of :data:`FORWARD_BYTES`. A chain is the receivers that post the same wants.

    ``families``: sources whose boxes are a rule (see :mod:`._rules`), besides what ``held`` lists for
    them (their other boxes). ``order``: the tensors in the sources' order (their manifests', by rank; the
    order receivers take them in), when it is not the order of ``held``'s lists."""
    index = _Index(held, wanted, families, order)
    members = sorted({*held, *wanted}) if me is None else [me]
    shares = [_share(index, m, bucket_bytes, caps or {}, forward) for m in members]
    pairs: dict[tuple[int, int], Plan[Piece]] = {}
    upstream: dict[tuple[int, int], int] = {}
    replicated: dict[tuple[str, Box, tuple[int, ...]], None] = {}
    problems: list[str] = []
    for share in shares:
        pairs.update(share.pairs)
        upstream.update(share.upstream)
        replicated.update(dict.fromkeys(share.replicated))
        problems += share.problems
    if me is None and problems:
        raise ManifestMismatchError(
            "the senders' and receivers' tensors do not fit together:\n" + "\n".join(problems)
        )
    sent: dict[int, int] = {}
    for (src, dst), cut in pairs.items():
        if upstream.get((src, dst), src) == src:
            sent[src] = sent.get(src, 0) + sum(p.nbytes for b in cut.buckets for p in b)
    return ShardPlan(
        index.wanted_order,
        index.dtypes,
        index.shapes,
        dict(sorted(pairs.items())),
        sent,
        tuple(replicated),
        upstream,
        index.receivers,
        index.sources,
        tuple(problems),
    )


@dataclass(slots=True)
class _Entry:
    """A distinct box of one tensor and the members that hold (or want) exactly it."""

    box: Box
    ranks: tuple[int, ...]
    group: int
    """The lowest rank of the members that post this whole layout (chains and owners are per group)."""
    place: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """Where a rule puts it: its key and index (see :mod:`._rules`); places of one key never overlap unless
    their indices are the same. None for a listed box."""


class _Sorted:
    """One tensor's entries sorted by where they start in the first dimension, with the running furthest end,
    so that the entries overlapping a box are found by bisection (tilings: O(log n + overlaps))."""

    __slots__ = ("ends", "entries", "starts")

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = sorted(entries, key=lambda e: (e.box.offset[:1], e.group))
        self.starts = [e.box.offset[0] if e.box.offset else 0 for e in self.entries]
        self.ends = list(
            itertools.accumulate(
                (e.box.offset[0] + e.box.shape[0] if e.box.offset else 1 for e in self.entries), max
            )
        )

    def overlapping(self, box: Box) -> list[_Entry]:
        if not box.shape:
            return list(self.entries)
        lo = bisect.bisect_right(self.ends, box.offset[0])
        hi = bisect.bisect_left(self.starts, box.offset[0] + box.shape[0])
        return [e for e in self.entries[lo:hi] if _overlaps(e.box, box)]


class _Index:
    """What every member knows of a sync's layouts (see the module's docstring, steps 1 and 2)."""

    def __init__(
        self,
        held: Mapping[int, Sequence[Held]],
        wanted: Mapping[int, Sequence[Held]],
        families: Sequence[Family] = (),
        order: Sequence[str] | None = None,
    ) -> None:
        self.held_by, self.wanted_by, self.families = held, wanted, families
        self.family_of = {rank: f for f in families for rank in f.at}
        self.sources = tuple(sorted({*held, *self.family_of}))
        self.receivers = tuple(sorted(wanted))
        self._ruled: dict[str, list[Family]] = {}
        self.order: list[str] = []
        self.dtypes: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.group_of: dict[int, tuple[int, ...]] = {}
        """Each receiver's group: the receivers that post its very layout, in rank order."""
        problems: list[str] = []
        self._holders = self._held(problems)
        self._wants = self._wanted(problems)
        if problems:
            more = f"\n... and {len(problems) - 50} more" if len(problems) > 50 else ""
            raise ManifestMismatchError(
                "the senders' and receivers' tensors do not fit together:\n" + "\n".join(problems[:50]) + more
            )
        if order is not None:
            self.order = [n for n in order if n in self.dtypes]
        self.position = {name: i for i, name in enumerate(self.order)}
        self.wanted_order = tuple(n for n in self.order if n in self._wants)
        self._sorted: dict[tuple[str, bool], _Sorted] = {}
        self._memo: dict[Any, list[_Entry]] = {}

    def _held(self, problems: list[str]) -> dict[str, list[_Entry]]:
        first: dict[str, int] = {}
        holders: dict[str, list[_Entry]] = {}
        for layout, ranks in _groups(self.held_by, self.families):
            if isinstance(layout, Family):
                self._rule(layout, first, problems)
                continue
            for h in layout:
                if h.name not in self.dtypes:
                    self.order.append(h.name)
                    self.dtypes[h.name], self.shapes[h.name] = h.dtype, h.global_shape
                    first[h.name] = ranks[0]
                elif (self.dtypes[h.name], self.shapes[h.name]) != (h.dtype, h.global_shape):
                    problems.append(
                        f"{h.name}: rank {ranks[0]} holds {h.dtype} {list(h.global_shape)}, rank "
                        f"{first[h.name]} {self.dtypes[h.name]} {list(self.shapes[h.name])}"
                    )
                    continue
                if not h.box.within(h.global_shape):
                    where = f"outside {list(h.global_shape)}"
                    problems.append(f"{h.name}: rank {ranks[0]} holds {_box(h.box)}, {where}")
                elif h.box.numel:
                    holders.setdefault(h.name, []).append(_Entry(h.box, ranks, ranks[0]))
        return holders

    def _rule(self, family: Family, first: dict[str, int], problems: list[str]) -> None:
        lowest = min(family.at)
        for name, (_, g, dtype) in family.tensors.items():
            if name not in self.dtypes:
                self.order.append(name)
                self.dtypes[name], self.shapes[name], first[name] = dtype, g, lowest
            elif (self.dtypes[name], self.shapes[name]) != (dtype, g):
                problems.append(
                    f"{name}: rank {lowest} holds {dtype} {list(g)}, rank {first[name]} {self.dtypes[name]} "
                    f"{list(self.shapes[name])}"
                )
                continue
            self._ruled.setdefault(name, []).append(family)

    def holds(self, rank: int) -> list[Held]:
        """What source ``rank`` holds: its listed boxes and those of its rule."""
        listed = list(self.held_by.get(rank, ()))
        family = self.family_of.get(rank)
        if family is not None:
            listed += [Held(n, d, g, family.box(rank, n)) for n, (_, g, d) in family.tensors.items()]
        return listed

    def _wanted(self, problems: list[str]) -> dict[str, list[_Entry]]:
        wants: dict[str, list[_Entry]] = {}
        for layout, ranks in _groups(self.wanted_by):
            assert not isinstance(layout, Family), "receivers post lists"
            self.group_of.update(dict.fromkeys(ranks, ranks))
            for w in layout:
                who = f"{w.name}: rank {ranks[0]}"
                if w.name not in self.dtypes:
                    problems.append(f"{who} wants {_box(w.box)}, which no sender holds")
                elif (self.dtypes[w.name], self.shapes[w.name]) != (w.dtype, w.global_shape):
                    problems.append(
                        f"{who} expects {w.dtype} {list(w.global_shape)}, the senders hold "
                        f"{self.dtypes[w.name]} {list(self.shapes[w.name])}"
                    )
                elif not w.box.within(w.global_shape):
                    problems.append(f"{who} wants {_box(w.box)}, outside {list(w.global_shape)}")
                else:
                    wants.setdefault(w.name, []).append(_Entry(w.box, ranks, ranks[0]))
        return wants

    def holding(self, name: str, box: Box) -> list[_Entry]:
        """The held entries of tensor ``name`` that overlap ``box``."""
        return self._query(name, box, True)

    def wanting(self, name: str, box: Box) -> list[_Entry]:
        return self._query(name, box, False)

    def _query(self, name: str, box: Box, held: bool) -> list[_Entry]:
        found = self._sorted.get((name, held))
        if found is None:
            entries = (self._holders if held else self._wants).get(name, [])
            found = self._sorted[(name, held)] = _Sorted(entries)
        out = found.overlapping(box)
        if held:
            for family in self._ruled.get(name, ()):
                out += self._places(family, name, box)
        return out

    def _places(self, family: Family, name: str, box: Box) -> list[_Entry]:
        """The places of ``family`` overlapping ``box`` in ``name``: the same for every tensor of one key and
        global shape (a model's layers), so worked out once per (key, shape, box)."""
        key, g, _ = family.tensors[name]
        memo = (id(family), key, g, box)
        found = self._memo.get(memo)
        if found is None:
            found = self._memo[memo] = [
                _Entry(b, r, r[0], place) for b, r, place in family.overlapping(name, box)
            ]
        return found


def _groups(
    layouts: Mapping[int, Sequence[Held]], families: Sequence[Family] = ()
) -> list[tuple[Sequence[Held] | Family, tuple[int, ...]]]:
    """Members grouped by the layout object they share (a list, or a family's rule), in rank order of each
    group's lowest rank: the order every member reads the sources' tensors in."""
    by: dict[int, tuple[Sequence[Held] | Family, list[int]]] = {}
    ruled = {rank: f for f in families for rank in f.at}
    for rank in sorted({*layouts, *ruled}):
        if rank in layouts:
            by.setdefault(id(layouts[rank]), (layouts[rank], []))[1].append(rank)
        if rank in ruled:
            by.setdefault(id(ruled[rank]), (ruled[rank], []))[1].append(rank)
    return [(layout, tuple(ranks)) for layout, ranks in by.values()]


@dataclass(slots=True)
class _Share:
    pairs: dict[tuple[int, int], Plan[Piece]] = field(default_factory=dict)
    upstream: dict[tuple[int, int], int] = field(default_factory=dict)
    replicated: list[tuple[str, Box, tuple[int, ...]]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _share(
    index: _Index, me: int, bucket_bytes: int, caps: Mapping[int, int], forward: frozenset[int]
) -> _Share:
    """Member ``me``'s pairs, chains, replicated regions and problems (steps 3 and 4)."""
    share = _Share()
    cuts: dict[tuple[int, int], list[tuple[int, str, Box]]] = {}
    """(source, receivers' group) -> the pieces of its cut: every receiver of a group takes the same."""
    groups: dict[int, tuple[int, ...]] = {}
    seen: dict[tuple[tuple[int, ...], Box], list[tuple[int, Box]]] = {}
    for w in index.wanted_by.get(me, ()):
        if not w.box.numel:
            continue
        got, group = 0, index.group_of[me]
        groups[group[0]] = group
        holding = index.holding(w.name, w.box)
        position = index.position[w.name]
        if _sole(holding):  # the common case (one holder per point): each holder's part, whole
            # the same for every tensor with the same holders (entries the index keeps: see _places)
            memo = (tuple(map(id, holding)), w.box)
            parts = seen.get(memo)
            if parts is None:
                parts = seen[memo] = [(e.ranks[0], _intersect(e.box, w.box)) for e in holding]
            for src, x in parts:
                cuts.setdefault((src, group[0]), []).append((position, w.name, x))
                got += x.numel
        else:
            for entry in holding:
                x = _intersect(entry.box, w.box)
                over = index.holding(w.name, x)
                for src in entry.ranks:
                    for piece in _owned(w.name, x, src, group[0], over):
                        cuts.setdefault((src, group[0]), []).append((position, w.name, piece))
                        got += piece.numel
        if got != w.box.numel:
            share.problems += [
                f"{w.name}: {_box(cell)} is wanted by rank {me} but no sender holds it"
                for cell in _missing(w.box, index.holding(w.name, w.box))[:5]
            ]
    for h in index.holds(me):
        if not h.box.numel:
            continue
        wanted = False
        mine = index.holding(h.name, h.box)
        sole = len(mine) == 1 and _sole(mine)  # nobody else holds any of it
        for want in index.wanting(h.name, h.box):
            x = _intersect(h.box, want.box)
            pieces = _owned(h.name, x, me, want.group, mine if sole else index.holding(h.name, x))
            if pieces:
                groups[want.group] = want.ranks
                cuts.setdefault((me, want.group), []).extend(
                    (index.position[h.name], h.name, p) for p in pieces
                )
            wanted = True
        if wanted and not sole:
            share.replicated += _replicas(index, h.name, h.box, me)
    chained: set[tuple[int, int]] = set()
    for src, lowest in cuts:
        ranks = groups[lowest]
        if src not in forward or len(ranks) <= len(index.sources):
            continue
        start = index.sources.index(src) * len(ranks) // len(index.sources) % len(ranks)
        chain = ranks[start:] + ranks[:start]
        share.upstream.update({(src, b): a for a, b in itertools.pairwise(chain)})
        chained.update((src, r) for r in ranks)
    for (src, lowest), found in sorted(cuts.items()):
        found.sort(key=lambda f: (f[0], f[2].offset))
        ranks = groups[lowest] if src == me else (me,)
        size = min(
            bucket_bytes,
            caps.get(src) or bucket_bytes,
            FORWARD_BYTES if (src, ranks[0]) in chained else bucket_bytes,
        )
        cut = _bucketed([(n, b) for _, n, b in found], index.dtypes, size)
        share.pairs.update(((src, dst), cut) for dst in ranks if dst != src)
    return share


def _sole(entries: list[_Entry]) -> bool:
    """Whether every point these entries cover has one holder: one rank each, and boxes that do not overlap
    (places of one key at distinct indices never do; listed boxes are compared, a few of them)."""
    if any(len(e.ranks) > 1 for e in entries):
        return False
    if len(entries) <= 1:
        return True
    places = [e.place for e in entries]
    if all(p is not None and p[0] == places[0][0] for p in places):  # type: ignore[index]
        return len(set(places)) == len(places)
    return len(entries) <= 8 and not any(
        _overlaps(a.box, b.box) for a, b in itertools.combinations(entries, 2)
    )


def _owned(name: str, x: Box, src: int, group: int, over: list[_Entry]) -> list[Box]:
    """The part of ``x`` (inside ``src``'s box) that ``src`` sends to the receivers of ``group``: all of it
    where no other source holds it; where several do, each region goes to one holder, chosen by the tensor's
    name and the group (see the module's docstring), as pieces of ``x`` cut by the other holders' edges."""
    holders = [(e.box, e.ranks) for e in over]
    if len(holders) == 1 and len(holders[0][1]) == 1:
        return [x]
    salt = zlib.crc32(name.encode()) + group
    out = []
    for cell in _cells(x, [b for b, _ in holders]):
        have = sorted({r for b, ranks in holders if b.contains(cell) for r in ranks})
        if have[salt % len(have)] == src:
            out.append(cell)
    return out


def _cells(x: Box, boxes: list[Box]) -> Iterator[Box]:
    """``x`` cut by every edge of ``boxes`` that lies inside it: each cell lies wholly inside or outside
    each box."""
    edges = [
        sorted(
            {x.offset[d], x.offset[d] + x.shape[d]}
            | {
                v
                for b in boxes
                for v in (b.offset[d], b.offset[d] + b.shape[d])
                if x.offset[d] < v < x.offset[d] + x.shape[d]
            }
        )
        for d in range(len(x.shape))
    ]
    for c in itertools.product(*(list(itertools.pairwise(e)) for e in edges)):
        yield Box(tuple(lo for lo, _ in c), tuple(hi - lo for lo, hi in c))


def _missing(want: Box, over: list[_Entry]) -> list[Box]:
    """The cells of ``want`` no entry of ``over`` holds (only to name them: a refusal's slow path)."""
    return [
        cell for cell in _cells(want, [e.box for e in over]) if not any(e.box.contains(cell) for e in over)
    ]


def _replicas(index: _Index, name: str, box: Box, me: int) -> list[tuple[str, Box, tuple[int, ...]]]:
    """The wanted regions of ``box`` (held by ``me``) another source holds too: (tensor, region, holders),
    the region being the intersection of two boxes and kept when some receiver wants part of it, so both
    holders name and keep it alike."""
    out: dict[Box, set[int]] = {}
    for e in index.holding(name, box):
        region = _intersect(box, e.box)
        for r in e.ranks:
            if r != me and (region in out or index.wanting(name, region)):
                out.setdefault(region, {me}).add(r)
    return [(name, region, tuple(sorted(rs))) for region, rs in out.items()]


def _overlaps(a: Box, b: Box) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offset, a.shape, b.offset, b.shape, strict=True)
    )


def _intersect(a: Box, b: Box) -> Box:
    lo = tuple(map(max, a.offset, b.offset))
    hi = map(min, map(operator.add, a.offset, a.shape), map(operator.add, b.offset, b.shape))
    return Box(lo, tuple(max(0, h - low) for low, h in zip(lo, hi, strict=True)))


def _split_rows(box: Box, parts: int) -> list[Box]:
    """``box`` cut along its first dimension into ``parts`` boxes of (nearly) equal rows."""
    if not box.shape or parts <= 1:
        return [box]
    rows = box.shape[0]
    step = -(-rows // parts)
    return [
        Box((box.offset[0] + r, *box.offset[1:]), (min(step, rows - r), *box.shape[1:]))
        for r in range(0, rows, step)
    ]


def _bucketed(boxes: list[tuple[str, Box]], dtypes: Mapping[str, str], bucket_bytes: int) -> Plan[Piece]:
    """Pack a pair's pieces into buckets of about ``bucket_bytes``: a piece bigger than that is cut by
    rows first (a single row bigger than a bucket travels alone)."""
    sizes: list[int] = []
    buckets: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    used = 0
    itemsizes = {d: element_size(d) for d in set(dtypes.values())}
    for name, box in boxes:
        itemsize = itemsizes[dtypes[name]]
        nbytes = math.prod(box.shape) * itemsize
        if box.shape and nbytes > bucket_bytes:
            row = nbytes // box.shape[0] if box.shape[0] else nbytes
            parts = _split_rows(box, -(-box.shape[0] // max(1, bucket_bytes // max(row, 1))))
        else:
            parts = [box]
        for part in parts:
            if part is not box:
                nbytes = math.prod(part.shape) * itemsize
            start = -(-used // ALIGN) * ALIGN
            if current and start + nbytes > bucket_bytes:
                sizes.append(used)
                buckets.append(tuple(current))
                current, start = [], 0
            current.append(Piece(name, part, start, nbytes))
            used = start + nbytes
    if current:
        sizes.append(used)
        buckets.append(tuple(current))
    return Plan.of_sizes(sizes, buckets)


def _box(box: Box) -> str:
    return f"the box at {list(box.offset)} of shape {list(box.shape)}"
