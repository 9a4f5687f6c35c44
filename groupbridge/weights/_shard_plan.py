"""One plan for a sync with many sources, computed alike by every member from the boxes (whole tensors or
:class:`~.shard.Shard` boxes) each source holds and each receiver wants, as the handshake told them:

1. **Checks** before any byte moves (every member raises the same :class:`ManifestMismatchError`, naming
   the tensor and the box): holders or receivers that disagree on dtype or global shape, a box outside its
   tensor, a wanted box (or part of one) nobody holds.
2. **Cells**: per tensor, the grid cut by every held and wanted box's edges, so each cell lies wholly inside
   or outside every box. A wanted cell is taken from the holder given the fewest bytes so far; one several
   sources hold is first split by rows, one part per holder (replicas and overlapping shards share the work).
3. **Pairs**: each (source, receiver) pair's pieces in tensor order, cut by rows to about a bucket and packed
   into buckets (aligned to :data:`ALIGN`): a :class:`.plan.Plan` per pair. Bytes travel once per pair.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..codec import dtype_from_name
from ..errors import ManifestMismatchError
from .plan import Plan
from .shard import Box

ALIGN = 16
FORWARD_BYTES = 1 << 20
"""The bucket size of a forwarded cut: each hop passes a bucket on once it landed whole, so a chain adds a
bucket's time per hop (1 MiB, a relay chunk: 0.04 s at 200 Mbit/s; for 2 sources into 4 replicas 2 MiB
measured 1.31x the lower bound, 1 MiB 1.19x)."""


@dataclass(frozen=True, slots=True)
class Held:
    """One box of one tensor, as a member holds or wants it."""

    name: str
    dtype: str
    """The dtype on the wire."""
    global_shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of tensor ``name`` in a bucket, at ``offset`` bytes."""

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
        return self.offset, self.nbytes, tensor[self.box.slices(held.offset)], wire or tensor.dtype


@dataclass(frozen=True, slots=True)
class ShardPlan:
    order: tuple[str, ...]
    """Every tensor some receiver wants, in the order the sources list them."""
    dtypes: Mapping[str, str]
    global_shapes: Mapping[str, tuple[int, ...]]
    pairs: Mapping[tuple[int, int], Plan[Piece]]
    """(source, receiver) -> the cut of the stream that pair moves."""
    sent: Mapping[int, int]
    """Bytes each source sends in all."""
    replicated: tuple[tuple[str, Box, tuple[int, ...]], ...] = ()
    """(tensor, cell, its holders) of every wanted cell several sources hold: each holder digests the whole
    cell and the vote compares them, so replicas that disagree are refused instead of mixed."""
    upstream: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """Forwarded pairs: (source, receiver) -> the receiver that passes the pair's buckets on to it (see
    :func:`plan_shards`'s ``forward``); every other pair comes from its source."""

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
) -> ShardPlan:
    """The plan (see the module's docstring); ManifestMismatchError lists every problem found.

    ``caps``: per source, the most bytes one of its buckets may hold (0 or absent: ``bucket_bytes``), as its
    transport reserved before the plan was known; only the plan can keep to it (pieces are aligned, and a
    cell split among holders is several pieces).

    ``forward``: the sources whose pairs may be forwarded (pairs across hosts, point to point). Where more
    receivers want one such source's cut than there are sources, sending it to each would load its link
    once per receiver while theirs idle: it goes to one, and each passes every bucket on to the next as it
    lands (a chain started at a receiver rotated by source, so each forwards about as much as it takes), in
    buckets of :data:`FORWARD_BYTES`."""
    problems: list[str] = []
    order: list[str] = []
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    holders: dict[str, list[tuple[int, Box]]] = {}
    for src in sorted(held):
        for h in held[src]:
            if h.name not in dtypes:
                order.append(h.name)
                dtypes[h.name], shapes[h.name] = h.dtype, h.global_shape
            elif (dtypes[h.name], shapes[h.name]) != (h.dtype, h.global_shape):
                problems.append(
                    f"{h.name}: rank {src} holds {h.dtype} {list(h.global_shape)}, rank "
                    f"{holders[h.name][0][0]} {dtypes[h.name]} {list(shapes[h.name])}"
                )
                continue
            if not h.box.within(h.global_shape):
                problems.append(f"{h.name}: rank {src} holds {_box(h.box)}, outside {list(h.global_shape)}")
                continue
            holders.setdefault(h.name, []).append((src, h.box))
    wants: dict[str, list[tuple[int, Box]]] = {}
    for dst in sorted(wanted):
        for w in wanted[dst]:
            if w.name not in dtypes:
                problems.append(f"{w.name}: rank {dst} wants {_box(w.box)}, which no sender holds")
            elif (dtypes[w.name], shapes[w.name]) != (w.dtype, w.global_shape):
                problems.append(
                    f"{w.name}: rank {dst} expects {w.dtype} {list(w.global_shape)}, the senders hold "
                    f"{dtypes[w.name]} {list(shapes[w.name])}"
                )
            elif not w.box.within(w.global_shape):
                problems.append(f"{w.name}: rank {dst} wants {_box(w.box)}, outside {list(w.global_shape)}")
            else:
                wants.setdefault(w.name, []).append((dst, w.box))
    load = dict.fromkeys(held, 0)
    pieces: dict[tuple[int, int], list[tuple[str, Box]]] = {}
    replicated: list[tuple[str, Box, tuple[int, ...]]] = []
    for name in order:
        for src, dst, box in _assign(name, holders.get(name, []), wants.get(name, []), load, problems,
                                     element_size(dtypes[name]), replicated):  # fmt: skip
            pieces.setdefault((src, dst), []).append((name, box))
    if problems:
        shown = "\n".join(problems[:50]) + (
            f"\n... and {len(problems) - 50} more" if len(problems) > 50 else ""
        )
        raise ManifestMismatchError(f"the senders' and receivers' tensors do not fit together:\n{shown}")
    caps = caps or {}
    upstream = _chains(pieces, forward, len(held))
    chained = set(upstream) | {(src, up) for (src, _), up in upstream.items()}  # every pair of a chain
    pairs = {
        pair: _bucketed(boxes, dtypes, min(bucket_bytes, caps.get(pair[0]) or bucket_bytes,
                                           FORWARD_BYTES if pair in chained
                                           else bucket_bytes))
        for pair, boxes in sorted(pieces.items())
        if boxes
    }  # fmt: skip
    order_ = tuple(n for n in order if n in wants)
    return ShardPlan(order_, dtypes, shapes, pairs, load, tuple(replicated), upstream)


def _chains(
    pieces: Mapping[tuple[int, int], list[tuple[str, Box]]], forward: frozenset[int], sources: int
) -> dict[tuple[int, int], int]:
    """Each forwarded pair's upstream receiver (see ``plan_shards``'s ``forward``)."""
    cuts: dict[tuple[int, str], list[int]] = {}
    for (src, dst), boxes in sorted(pieces.items()):
        if src in forward and boxes:
            cuts.setdefault((src, repr(boxes)), []).append(dst)
    upstream: dict[tuple[int, int], int] = {}
    for n, ((src, _), takers) in enumerate(sorted(cuts.items())):
        if len(takers) <= sources:
            continue
        start = n * len(takers) // max(sources, 1) % len(takers)
        chain = takers[start:] + takers[:start]
        upstream.update({(src, b): a for a, b in itertools.pairwise(chain)})
    return upstream


def _assign(
    name: str, holders: list[tuple[int, Box]], wants: list[tuple[int, Box]], load: dict[int, int],
    problems: list[str], itemsize: int, replicated: list[tuple[str, Box, tuple[int, ...]]],
) -> list[tuple[int, int, Box]]:  # fmt: skip
    """(source, receiver, box) for every cell of tensor ``name`` some receiver wants; each such cell that
    several sources hold goes to ``replicated`` too."""
    if not wants:
        return []
    boxes = [b for _, b in holders] + [b for _, b in wants]
    dims = len(wants[0][1].shape)
    edges = [sorted({e for b in boxes for e in (b.offset[d], b.end()[d])}) for d in range(dims)]
    cells = [  # a scalar: one cell, Box((), ())
        Box(tuple(lo for lo, _ in c), tuple(hi - lo for lo, hi in c))
        for c in itertools.product(*(list(itertools.pairwise(e)) for e in edges))
    ]
    out: list[tuple[int, int, Box]] = []
    missing: list[Box] = []
    for cell in cells:
        if cell.numel == 0:
            continue
        takers = [dst for dst, b in wants if b.contains(cell)]
        if not takers:
            continue
        have = [src for src, b in holders if b.contains(cell)]
        if not have:
            missing.append(cell)
            continue
        if len(have) > 1:
            replicated.append((name, cell, tuple(have)))
        for part in _split_rows(cell, len(have)):
            src = min(have, key=lambda s: (load[s], s))
            load[src] += part.numel * itemsize * len(takers)
            out.extend((src, dst, part) for dst in takers)
    for cell in missing[:5]:
        problems.append(f"{name}: {_box(cell)} is wanted but no sender holds it")
    return out


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
    for name, box in boxes:
        itemsize = element_size(dtypes[name])
        row = box.numel // box.shape[0] * itemsize if box.shape and box.shape[0] else box.numel * itemsize
        rows = max(1, bucket_bytes // max(row, 1))
        parts = (
            _split_rows(box, -(-box.shape[0] // rows))
            if box.shape and box.numel * itemsize > bucket_bytes
            else [box]
        )
        for part in parts:
            nbytes = part.numel * itemsize
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
