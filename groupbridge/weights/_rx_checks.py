"""A receiver's part of the handshake, transports aside: its verdict on version, size and tensors, the boxes
it wants when its targets are boxes (:func:`wants_of`), and for ``receive(reads=...)`` what it posts for
the next sync and whether the boxes still fit."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from ..codec import dtype_name
from ._header import Header, Verdict
from .manifest import Entry, Manifest, compare, expected_specs, mismatch_message, tensors_of
from .shard import Box, Shard, box_of

T = TypeVar("T")


def _renamed(e: Entry, rename: Callable[[str], str]) -> Entry:
    return Entry(rename(e.name), e.shape, e.dtype, e.wire_dtype, e.alias_of)


def refusal(
    held: int | None, header: Header, manifest: Manifest, *, rename: Callable[[str], str],
    expected: dict[str, tuple[tuple[int, ...], str]] | None, accept: Callable[[Manifest], str | None] | None,
    allow_stale: bool, rank: int, fits: Fits | None = None,
) -> Verdict | None:  # fmt: skip
    """A receiver's refusal of a sync, or None: a version not newer than ``held``, more bytes than this host's
    memory where no target or ``expected=`` bounds them, other tensors than expected, ``accept`` saying no."""
    if not allow_stale and held is not None and header.version <= held:
        return Verdict(f"holds version {held}; version {header.version} is not newer", "stale", holds=held)
    if expected is None and manifest.nbytes > (cap := host_memory()):
        return Verdict(
            f"rank {rank}: version {header.version} announces {manifest.nbytes / 2**30:.1f} GiB of tensors, "
            f"more than this host's memory ({cap / 2**30:.1f} GiB): nothing is allocated from sizes that no "
            "target and no expected= bound",
            "size",
        )
    renamed = None
    if expected is not None and not (fits is not None and fits.held(manifest, expected)):
        renamed = Manifest(tuple(_renamed(e, rename) for e in manifest.entries))
        problems = compare(renamed, expected)
        if any(problems.values()):
            return Verdict(mismatch_message(problems, f"rank {rank}"), "manifest")
        if fits is not None:
            fits.hold(manifest, expected)
    if accept is not None:
        renamed = renamed or Manifest(tuple(_renamed(e, rename) for e in manifest.entries))
        if (problem := accept(renamed)) is not None:
            return Verdict(problem, "manifest")
    return None


class Fits:
    """The last manifest a receiver found to fit the tensors it expects. A repeat sync brings the same
    objects (the sources' manifest kept by its digest, the expectations kept by the receiver), so it
    compares none of their entries again: a comparison costs microseconds a tensor, on every receiver."""

    def __init__(self) -> None:
        self._last: tuple[Manifest, object] | None = None

    def held(self, manifest: Manifest, expected: object) -> bool:
        return self._last is not None and self._last[0] is manifest and self._last[1] is expected

    def hold(self, manifest: Manifest, expected: object) -> None:
        self._last = (manifest, expected)


class Targets:
    """A ``receive_into`` target as the handshake sees it: its tensors by name (``named``), what it expects
    of the sources, the boxes it posts as wants, its tensors' addresses (which tag the base a delta is
    applied to) and where a plan's pieces land in it (:meth:`slots`). Deriving them walks every tensor, a few
    microseconds each; :meth:`of` returns the last sync's when the target holds the same tensor objects at
    the same addresses, as a training loop's does. The receiver keeps it, and so the target's tensors, until
    its next receive or its close."""

    def __init__(self, named: dict[str, Any], renames: bool, key: list[tuple[Any, ...]] | None) -> None:
        self.named, self.renames, self.key = named, renames, key
        self._held = [v.tensor if type(v) is Shard else v for v in named.values()]
        """The tensors the key names by ``id``: held, so that no other object takes one of their ids (a
        Shard's tensor may be replaced in the Shard itself)."""
        self.wants = wants_of(named, renames)
        self.addresses = tuple(data_ptr(t) for t in named.values())
        self._expected: dict[str, tuple[tuple[int, ...], str]] | None = None
        self._slots: tuple[object, Any] | None = None

    def slots(self, plan: object, make: Callable[[], T]) -> T:
        """What ``make`` derives from this target for ``plan`` (where its pieces land), made once per plan."""
        if self._slots is None or self._slots[0] is not plan:
            self._slots = (plan, make())
        return self._slots[1]

    @property
    def expected(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """What the target expects (:func:`~.manifest.expected_specs`), made when first asked for."""
        if self._expected is None:
            self._expected = expected_specs(self.named)
        return self._expected

    @classmethod
    def of(cls, target: Any, renames: bool, last: Targets | None) -> Targets:
        named = tensors_of(target, "receive_into()")
        key = _identity(named)
        if last is not None and key is not None and last.key == key and last.renames == renames:
            return last
        return cls(named, renames, key)


def _identity(named: dict[str, Any]) -> list[tuple[Any, ...]] | None:
    """What a target's derived parts depend on: per tensor (or :class:`~.shard.Shard`), its name, which
    object it is, its address, shape, strides, dtype and device, and a Shard's box; None for any other value
    (a DTensor's box is its mesh's to say), which is derived anew each sync. Objects by ``id``: the
    :class:`Targets` holding this key holds them."""
    out: list[tuple[Any, ...]] = []
    for name, v in named.items():
        shard = v if type(v) is Shard else None
        t = shard.tensor if shard is not None else v
        if type(t) not in _PLAIN:
            return None
        box = (shard.offset, shard.global_shape) if shard is not None else None
        out.append((name, id(v), id(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, box))
    return out


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def host_memory() -> int:
    """This host's physical memory: the cap on what ``receive()`` allocates from announced sizes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: a bound still, if a loose one
        return 1 << 40


class Reads:
    """One handshake of ``receive(reads=...)``: the wants posted (learned in an earlier one), whether they
    hold for this sync's sources, and the wants learned from this sync's manifest for the next one."""

    def __init__(
        self,
        reads: Callable[[Manifest], Mapping[str, Box | None]],
        posted: tuple[str, dict[str, Any]] | None,
        rank: int,
    ) -> None:  # fmt: skip
        self.reads, self.posted, self.rank = reads, posted, rank
        self.key: str | None = None
        self.used = False
        self.learned = posted
        """What to post next time: what this handshake's check learned, else what was posted this time."""

    def seen(self, key: str, used: bool) -> None:
        self.key, self.used = key, used

    def accepting(self, accept: Callable[[Manifest], str | None] | None) -> Callable[[Manifest], str | None]:
        def check(manifest: Manifest) -> str | None:
            problem = accept(manifest) if accept is not None else None
            if problem is not None and self.used:
                self.learned = None  # maybe refused for what the boxes left out: the next sync brings all
            if problem is not None or self.key is None:
                return problem
            wants = _wants_wire(manifest, self.reads(manifest))
            self.learned = (self.key, wants) if wants is not None else None
            if self.used and self.posted is not None:
                return _outside(self.posted[1], wants, self.rank)
            return None

        return check


def _wants_wire(manifest: Manifest, reads: Mapping[str, Box | None]) -> dict[str, Any] | None:
    """The wants a receiver posts for ``reads`` (None when every box read is its whole tensor); a tensor
    read as None (not read at all) is left out of them, so not yielded when they are used."""
    wants: dict[str, Any] = {}
    partial_box = False
    for e in manifest.entries:  # tied names too: a sync with boxes carries each name as a tensor of its own
        whole = Box((0,) * len(e.shape), tuple(e.shape))
        if e.name in reads and reads[e.name] is None:
            continue  # alone, no reason to ask for boxes: an unread tied name costs nothing whole
        box = reads.get(e.name) or whole
        if not box.within(e.shape):
            raise ValueError(f"the box read of {e.name} ({box}) lies outside its shape {list(e.shape)}")
        partial_box = partial_box or box != whole
        wants[e.name] = [e.wire_dtype, list(e.shape), list(box.offset), list(box.shape)]
    return wants if partial_box else None


def _outside(posted: dict[str, Any], now: dict[str, Any] | None, rank: int) -> str | None:
    """Why the boxes read now do not fit in the boxes posted (which this sync brings), or None."""
    for name, w in (now or {}).items():
        p = posted.get(name)
        if p is None or not Box(tuple(p[2]), tuple(p[3])).contains(Box(tuple(w[2]), tuple(w[3]))):
            return (
                f"rank {rank}: its loader now reads {name} beyond the box it asked for; the next sync "
                "brings what it reads now"
            )
    if now is None and posted:
        return f"rank {rank}: its loader now reads every tensor whole; the next sync brings them whole"
    return None


def wants_of(targets: dict[str, Any], renames: bool) -> dict[str, Any] | None:
    """What this receiver posts in the handshake when some target is a box of a global tensor (a
    :class:`~.shard.Shard` or a DTensor): every target's box, by name on the wire; else None (every
    tensor, whole)."""
    shards = {n: box_of(v) for n, v in targets.items()}
    if all(s is None for s in shards.values()):
        return None
    if renames:
        raise ValueError("receiving into Shard targets takes the names on the wire: drop rename=")
    wants = {}
    for name, value in targets.items():
        s = shards[name] or Shard(value, tuple(value.shape), (0,) * value.dim())
        wants[name] = [
            dtype_name(s.tensor.dtype),
            list(s.global_shape),
            list(s.offset),
            list(s.tensor.shape),
        ]
    return wants


def data_ptr(t: Any) -> int:
    shard = box_of(t)
    return (shard.tensor if shard is not None else t).data_ptr()
