"""Byte-level helpers shared by sender and receiver: views, packing, in-place bucket detection, the views kept
between syncs (a bucket's digests: :mod:`._digests`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from .plan import Plan, Segment

T = TypeVar("T")

MAX_GAP_BYTES = 8
"""Largest hole between two consecutive tensors that an in-place receive may write over: alignment padding
is smaller than the largest element size (8); a real tensor hiding in it is not expected."""


def typed_view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """View ``buf[offset:]`` (uint8) as a tensor of ``dtype`` and ``shape`` without copying."""
    return buf[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(tuple(shape))


def new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer whose pages are already touched (a first touch inside a timed transfer costs several fold)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def in_place_bucket(
    plan: Plan, k: int, tensors: Sequence[torch.Tensor | None], *, receiving: bool
) -> torch.Tensor | None:
    """A uint8 view of bucket ``k`` inside the tensors' own storage (every piece in one storage at the plan's
    offsets, as after :func:`groupbridge.flatten_`), or None. A receiving side, which writes over the holes
    between pieces, also requires them to be alignment padding only."""
    segments = plan.buckets[k]
    if not segments:
        return None
    start, end = plan.bucket_range(k)
    length = end - start
    base = None
    storage = None
    prev_end = 0
    for seg in segments:
        t = tensors[seg.index]
        if t is None or not t.is_contiguous():
            return None
        st = t.untyped_storage()
        if storage is None:
            storage = st
        elif st.data_ptr() != storage.data_ptr():
            return None
        b = t.data_ptr() + seg.tensor_offset - seg.bucket_offset
        if base is None:
            base = b
        elif b != base:
            return None
        if receiving and seg.bucket_offset - prev_end > MAX_GAP_BYTES:
            return None
        prev_end = seg.bucket_offset + seg.nbytes
    assert storage is not None and base is not None
    if receiving and length - prev_end > MAX_GAP_BYTES:
        return None
    offset = base - storage.data_ptr()
    if offset < 0 or offset + length > storage.nbytes():
        return None
    view = torch.empty(0, dtype=torch.uint8, device=tensors[segments[0].index].device)  # type: ignore[union-attr]
    return view.set_(storage, offset, (length,), (1,))


Part = tuple[int, int, torch.Tensor, torch.dtype]
"""A piece of a bucket: (byte offset in the bucket, bytes, the tensor it is read from or written to, the
dtype it travels as). The tensor is a slice of one tensor's bytes, or a box of it (a view, strided or not)."""


def pack_parts(view: torch.Tensor, parts: Iterable[Part]) -> None:
    """Copy a bucket's pieces into ``view`` (uint8), zeroing the alignment holes so that its bytes (and
    digest, and delta) depend on the tensors alone. A piece is cast to the dtype it travels as while copied:
    into this warm buffer, a quarter of the cost of casting into a fresh tensor first (its page faults)."""
    parts = list(parts)
    copy_in(parts, layout(view, parts, runs=True))


def unpack_parts(view: torch.Tensor, parts: Iterable[Part]) -> None:
    """The inverse of :func:`pack_parts`: each piece of ``view`` into its tensor."""
    parts = list(parts)
    copy_out(parts, layout(view, parts))


class Layout(NamedTuple):
    """A bucket's pieces as views of the buffer it is packed into or lands in (see :func:`layout`)."""

    views: list[torch.Tensor]
    """Per piece, its bytes in the buffer as the dtype it travels as and its tensor's shape, or as bytes
    (see ``raw``)."""
    raw: frozenset[int]
    """The pieces whose start is not aligned for their dtype: their views are bytes, copied through a cast
    (a pack) or an aligned copy (an unpack)."""
    holes: list[torch.Tensor]
    """The bytes between pieces (alignment padding) and after the last, zeroed by a pack."""
    runs: tuple[tuple[int, int, torch.Tensor], ...] = ()
    """Pieces ``i`` to ``j`` (excluded) end to end in the buffer, each in the dtype it travels as, of one
    rank and one shape past the first dimension: packed by one ``torch.cat`` into ``view``, their bytes in
    the buffer shaped as that concatenation. ``torch._foreach_copy_`` dispatches each piece on its own
    (under a microsecond apiece); the concatenation copies them in one call (see docs/results.md)."""
    single: list[int] | None = None
    """The typed pieces (not ``raw``) outside every run, which a pack copies one by one; None: all of them."""


def layout(view: torch.Tensor, parts: Sequence[Part], *, runs: bool = False) -> Layout:
    """The views of ``parts`` in ``view`` (uint8), and with ``runs`` (a pack's) its :attr:`Layout.runs`. Made
    in Python, a few microseconds a piece: a bucket of a sharded model's norms holds thousands of pieces, so a
    sync that repeats keeps them (:class:`Kept`)."""
    views, raw, holes = [], set(), []
    prev = 0
    for i, (offset, nbytes, t, dtype) in enumerate(parts):
        if offset > prev:
            holes.append(view[prev:offset])
        out = view[offset : offset + nbytes]
        if dtype is torch.uint8 and t.dim() == 1:  # bytes as they lie (a segment of a tensor)
            views.append(out)
        elif out.storage_offset() % dtype.itemsize == 0:
            views.append(out.view(dtype).view(t.shape))
        else:
            views.append(out)
            raw.add(i)
        prev = offset + nbytes
    if view.numel() > prev:
        holes.append(view[prev:])
    found = _runs(view, parts, raw) if runs else ()
    covered = {i for first, end, _ in found for i in range(first, end)}
    single = [i for i in range(len(parts)) if i not in raw and i not in covered] if found else None
    return Layout(views, frozenset(raw), holes, found, single)


MIN_RUN = 4
"""Fewer pieces in a row than this are packed by the one ``torch._foreach_copy_`` of the rest: where the run
is the whole bucket, this is where a concatenation stops costing more than the pieces' dispatch (see
docs/results.md); in a bucket whose other pieces still take their own call, a run this short saves less."""

MAX_RUN_PIECE = 1 << 16
"""Bytes past which a piece joins no run: its copy costs more than its dispatch."""


def _runs(
    view: torch.Tensor, parts: Sequence[Part], raw: set[int]
) -> tuple[tuple[int, int, torch.Tensor], ...]:
    """The runs of :attr:`Layout.runs` among ``parts`` (laid out in ``view``), each at least :data:`MIN_RUN`
    pieces of at most :data:`MAX_RUN_PIECE` bytes long. Only in host memory, every piece there too: a
    concatenation takes its inputs on its output's device, and on an accelerator it is not measured yet."""
    if view.device.type != "cpu":
        return ()
    runs: list[tuple[int, int, torch.Tensor]] = []
    first, n = 0, len(parts)

    def joins(t: torch.Tensor, nbytes: int, dtype: torch.dtype) -> bool:
        return t.dtype == dtype and nbytes <= MAX_RUN_PIECE and t.device == view.device

    while first < n:
        end = first + 1
        offset, nbytes, t, dtype = parts[first]
        if first not in raw and joins(t, nbytes, dtype) and t.dim() > 0:
            stop, trailing = offset + nbytes, t.shape[1:]
            while end < n and end not in raw:
                o, b, u, d = parts[end]
                if (
                    o != stop
                    or d != dtype
                    or not joins(u, b, dtype)
                    or u.dim() != t.dim()
                    or u.shape[1:] != trailing
                ):
                    break
                stop += b
                end += 1
            if end - first >= MIN_RUN:
                rows = sum(parts[i][2].shape[0] for i in range(first, end))
                runs.append((first, end, view[offset:stop].view(dtype).view(rows, *trailing)))
        first = end
    return tuple(runs)


def copy_in(parts: Sequence[Part], at: Layout) -> None:
    """Pack: every piece into its view, the holes zeroed: a run (:attr:`Layout.runs`) by one ``torch.cat``,
    the other pieces by one ``torch._foreach_copy_`` (cast to the dtype they travel as on the way)."""
    with torch.no_grad():
        if at.holes:
            torch._foreach_zero_(at.holes)
        for i in at.raw:
            _, _, t, dtype = parts[i]
            at.views[i].copy_(t.to(dtype).reshape(-1).view(torch.uint8))
        for first, end, out in at.runs:
            torch.cat([p[2] for p in parts[first:end]], out=out)
        if at.single is not None:
            views, tensors = [at.views[i] for i in at.single], [parts[i][2] for i in at.single]
        else:
            views, tensors = _typed(parts, at)
        if views:
            torch._foreach_copy_(views, tensors)


def copy_out(parts: Sequence[Part], at: Layout, rows: Rows | None = None) -> None:
    """Unpack: every piece's view into its tensor (one ``torch._foreach_copy_``, or one indexed copy where
    ``rows`` says every piece lies in one storage)."""
    with torch.no_grad():
        if rows is not None:
            rows.scatter()
            return
        for i in at.raw:
            _, _, t, dtype = parts[i]
            t.copy_(at.views[i].clone().view(dtype).view(t.shape))  # the clone is aligned
        views, tensors = _typed(parts, at)
        if views:
            torch._foreach_copy_(tensors, views)


class Rows(NamedTuple):
    """A bucket's pieces that all land in one storage, as rows of one width: unpacked by one indexed copy.
    ``torch._foreach_copy_`` dispatches each piece on its own, about a microsecond apiece, and a bucket of a
    sharded model's pieces for one receiver holds thousands of a few dozen bytes (see :func:`rows`)."""

    storage: torch.Tensor
    """The storage's bytes as rows (uint8, two dimensions)."""
    at: torch.Tensor
    """The storage rows the pieces' rows go to, in order (int64)."""
    bucket: torch.Tensor
    """The bucket's bytes as rows."""
    pick: torch.Tensor | None
    """The bucket rows that hold pieces, in order; None: the first ``len(at)`` (pieces end to end)."""

    def scatter(self) -> None:
        src = self.bucket[: len(self.at)] if self.pick is None else self.bucket.index_select(0, self.pick)
        self.storage.index_copy_(0, self.at, src)


MIN_ROW_PIECES = 64
"""Fewer pieces than this are unpacked one by one: the indexed copy's own setup costs tens of microseconds."""

ROWS_PER_PIECE = 64
"""The most rows per piece an indexed copy may take: past that, its rows cost more than a piece's dispatch."""


def rows(view: torch.Tensor, parts: Sequence[Part]) -> Rows | None:
    """``parts`` unpacked from ``view`` as rows (see :class:`Rows`), or None where that is not cheaper or not
    exact: fewer than :data:`MIN_ROW_PIECES` pieces, pieces in several storages, off the CPU, cast or not
    contiguous, or rows so narrow (the widest that divides every offset and size) that they outnumber the
    pieces :data:`ROWS_PER_PIECE` times. The caller keeps the result while ``parts``' tensors are the same."""
    if len(parts) < MIN_ROW_PIECES or view.device.type != "cpu":
        return None
    storage = parts[0][2].untyped_storage()
    base, width = storage.data_ptr(), 0
    if view.untyped_storage().data_ptr() == base:  # an indexed copy refuses a source inside its destination
        return None
    offsets, ats, sizes = [], [], []
    for offset, nbytes, t, dtype in parts:
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            return None
        if t.untyped_storage().data_ptr() != base:
            return None
        at = t.data_ptr() - base
        offsets.append(offset)
        ats.append(at)
        sizes.append(nbytes)
        width = math.gcd(width, offset, at, nbytes)
    if width == 0 or sum(sizes) // width > ROWS_PER_PIECE * len(parts):
        return None
    cpu = torch.device("cpu")  # whatever the caller's default device
    counts = torch.tensor(sizes, device=cpu) // width
    starts = torch.cumsum(counts, 0) - counts  # where each piece's rows start among the pieces' rows
    ramp = torch.arange(int(counts.sum()), device=cpu)
    into = torch.repeat_interleave(torch.tensor(ats, device=cpu) // width - starts, counts) + ramp
    pick = torch.repeat_interleave(torch.tensor(offsets, device=cpu) // width - starts, counts) + ramp
    own = torch.empty(0, dtype=torch.uint8, device=cpu).set_(
        storage, 0, (storage.nbytes() // width * width,), (1,)
    )
    bucket = view[: view.numel() // width * width].view(-1, width)
    return Rows(own.view(-1, width), into, bucket, None if torch.equal(pick, ramp) else pick)


def _typed(parts: Sequence[Part], at: Layout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The pieces copied as they are typed (all but ``at.raw``): their views, their tensors."""
    if not at.raw:
        return at.views, [p[2] for p in parts]
    keep = [i for i in range(len(parts)) if i not in at.raw]
    return [at.views[i] for i in keep], [parts[i][2] for i in keep]


class Kept:
    """Views made once and reused while what they were made from is unchanged: a repeat sync's plan is the
    same object (kept by its posts' digest), its buffers the same memory, so its pieces' views are too.

    An entry is found by its ``owner`` (held, so that its ``id`` is not reused), what it is, and ``at``
    (what the views were made in: a buffer's address and size; one owner may have several, as one cut's
    bucket packed for two receivers). Entries not used for a whole sync are dropped (:meth:`sweep`, at each
    sync's start), so the memory they view is held at most one sync longer than its last use."""

    def __init__(self) -> None:
        self._now: dict[tuple[int, str, Hashable], tuple[object, Any]] = {}
        self._last: dict[tuple[int, str, Hashable], tuple[object, Any]] = {}

    def get(self, owner: object, what: str, at: Hashable, make: Callable[[], T]) -> T:
        key = (id(owner), what, at)
        kept = self._now.get(key) or self._last.pop(key, None)
        if kept is not None and kept[0] is owner:
            self._now[key] = kept
            return kept[1]  # type: ignore[no-any-return]
        value = make()
        self._now[key] = (owner, value)
        return value

    def sweep(self) -> None:
        """A sync begins: what the last one did not use is let go."""
        self._last, self._now = self._now, {}

    def clear(self) -> None:
        self._now.clear()
        self._last.clear()


class Same:
    """``obj`` in a :class:`Kept` entry's ``at``: equal to another only if it is the same object (and held,
    so that no other object takes its ``id`` meanwhile)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def address(view: torch.Tensor) -> tuple[torch.device, int, int]:
    """Where a buffer's views are valid: its device, address and size."""
    return view.device, view.data_ptr(), view.numel()


def _segments(
    segs: Sequence[Segment], tensors: Sequence[torch.Tensor | None], wire: Sequence[torch.dtype] | None
) -> Iterator[Part]:
    """A fan-out bucket's segments as parts: byte ranges of contiguous tensors, cast where ``wire`` says."""
    for seg in segs:
        t = tensors[seg.index]
        assert t is not None
        dtype = wire[seg.index] if wire is not None else t.dtype
        if t.dtype == dtype:
            yield seg.part((t, None))
        else:
            first = seg.tensor_offset // dtype.itemsize
            yield (
                seg.bucket_offset,
                seg.nbytes,
                t.reshape(-1)[first : first + seg.nbytes // dtype.itemsize],
                dtype,
            )


def pack(
    view: torch.Tensor,
    segs: Sequence[Segment],
    tensors: Sequence[torch.Tensor | None],
    wire: Sequence[torch.dtype] | None = None,
) -> None:
    """Pack a fan-out bucket's segments from ``tensors`` (by manifest index) into ``view``, each cast to its
    ``wire`` dtype where that differs (see :func:`pack_parts`)."""
    pack_parts(view, _segments(segs, tensors, wire))


def unpack(view: torch.Tensor, segs: Sequence[Segment], tensors: Sequence[torch.Tensor]) -> None:
    """The inverse of :func:`pack`: copy a bucket's segments into ``tensors`` (contiguous, wire dtype)."""
    unpack_parts(view, _segments(segs, tensors, None))


class BufferCache:
    """Reusable, pre-touched buffers kept between syncs (see :func:`new_buffer`)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.kept = Kept()
        """Views of these buffers (and of what lands in them) kept for the syncs that repeat a plan."""

    def get(self, slot: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(slot)
        same_device = (
            buf is not None and buf.device.type == device.type and device.index in (None, buf.device.index)
        )
        if buf is None or buf.numel() < nbytes or not same_device:
            self._buffers.pop(slot, None)  # free the old one before allocating its successor
            if buf is not None:
                self.kept.clear()  # the views kept of it, too
            del buf
            buf = self._buffers[slot] = new_buffer(nbytes, device)
        return buf[:nbytes]

    def clear(self) -> None:
        self._buffers.clear()
        self.kept.clear()
