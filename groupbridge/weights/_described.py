"""What a source sends: its (name, tensor) pairs on the wire's names, their manifest, and the boxes of global
tensors among them (an iterator stays lazy: see ``WeightSender.send``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..stateless import StatelessGroup
from ._session import laid_out_in_place
from .manifest import Manifest, tensors_of
from .plan import Plans
from .shard import Shard, box_of

Pairs = list[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]]
"""A source's (name, tensor) pairs: a list, or an iterator consumed lazily."""

Boxes = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
"""Boxes of global tensors a source holds: name -> (global shape, offset)."""

Specs = Mapping[
    str, tuple[Sequence[int], torch.dtype] | tuple[Sequence[int], torch.dtype, Sequence[int], Sequence[int]]
]
"""A lazy source's description: name -> (shape, dtype), or (shape, dtype, global shape, offset) for a box."""

NamedTensors = torch.nn.Module | Mapping[str, torch.Tensor | Shard] | Iterable[tuple[str, torch.Tensor]]
"""What ``send`` takes: a module, a mapping, or (name, tensor) pairs (a generator stays lazy)."""


def named_tensors_of(obj: NamedTensors) -> Pairs:
    """Normalise a module, mapping or iterable of pairs; iterators stay lazy."""
    if isinstance(obj, (torch.nn.Module, Mapping)):
        return list(tensors_of(obj).items())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if isinstance(obj, Iterable):
        return iter(obj)
    raise TypeError(
        f"expected a module, a mapping or an iterable of (name, tensor), got {type(obj).__name__}"
    )


class Described:
    """A source's description, remembered from one send to the next (what a lazy source's next sends are
    described by)."""

    def __init__(
        self, group: StatelessGroup, rename: Callable[[str], str], wire_dtype: torch.dtype | None
    ) -> None:
        self.group = group
        self._rename = rename
        self.wire_dtype = wire_dtype
        self.manifest: Manifest | None = None
        """The previous send's manifest."""
        self.shards: Boxes = {}
        """The boxes the previous send held."""
        self._signature: tuple[Manifest, list[tuple[str, torch.Size, torch.dtype]]] | None = None
        """A manifest with no tied names and the (name, shape, dtype) of the tensors it was built from."""

    def remember(self, manifest: Manifest, shards: Boxes) -> None:
        self.manifest, self.shards = manifest, shards

    def describe(self, named_tensors: NamedTensors, specs: Specs | None) -> tuple[Pairs, Manifest, Boxes]:
        """The (name, tensor) pairs on the wire's names, their manifest (of the local tensors), and the
        boxes of global tensors among them (``gb.Shard``, DTensor): name -> (global shape, offset)."""
        items = named_tensors_of(named_tensors)
        if not isinstance(items, list):
            if specs is not None:
                manifest, shards = self._from_specs(specs)
                return self._lazy(items, shards), manifest, shards
            if self.manifest is not None:
                return self._lazy(items, self.shards), self.manifest, self.shards
            self.group.log.warning(
                "first send of an iterator without specs=: collecting it once to describe it"
            )
            items = list(items)
        pairs, shards = [], {}
        rename = self._rename
        for n, value in items:
            name = rename(n)
            shard = box_of(value)
            if shard is None:
                pairs.append((name, value))
                continue
            if shard.global_shape != shard.tensor.shape:  # a box, not the whole tensor
                shards[name] = (shard.global_shape, shard.offset)
            pairs.append((name, shard.tensor))
        return pairs, self._manifest_of(pairs), shards

    def _manifest_of(self, pairs: list[tuple[str, torch.Tensor]]) -> Manifest:
        """The manifest of ``pairs``: the previous send's when it describes them, as a training loop's tensors
        are every step. That is found by comparing two lists whole (names, shapes and dtypes, then addresses
        all distinct: no tied names) instead of building each entry and comparing it."""
        try:
            signature: list[tuple[str, torch.Size, torch.dtype]] | None = [
                (n, t.shape, t.dtype) for n, t in pairs
            ]
            untied = _untied(pairs)
        except AttributeError:  # a value that is not a tensor: the manifest's build says which
            signature, untied = None, False
        last = self._signature
        if (
            signature is not None
            and untied
            and last is not None
            and last[0] is self.manifest
            and last[1] == signature
        ):
            return last[0]
        manifest = Manifest.build(pairs, self.wire_dtype, like=self.manifest)
        untied = all(e.alias_of is None for e in manifest.entries)
        self._signature = (manifest, signature) if signature is not None and untied else None
        return manifest

    def _from_specs(self, specs: Specs) -> tuple[Manifest, Boxes]:
        """A lazy source's manifest and boxes from ``specs``: name -> (shape, dtype), or (shape, dtype,
        global shape, offset) for a box of a global tensor."""
        meta, shards = [], {}
        for n, spec in specs.items():
            if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 4):
                raise ValueError(
                    f"specs[{n!r}] must be (shape, dtype) or (shape, dtype, global_shape, offset), got "
                    f"{spec!r}"
                )
            name, shape, dtype = self._rename(n), tuple(spec[0]), spec[1]
            meta.append((name, torch.empty(shape, dtype=dtype, device="meta")))
            if len(spec) == 4:
                box = Shard(meta[-1][1], tuple(spec[2]), tuple(spec[3]))  # checks that the box fits
                if not box.whole:
                    shards[name] = (box.global_shape, box.offset)
        return Manifest.build(meta, self.wire_dtype), shards

    def _lazy(self, items: Iterator[tuple[str, Any]], shards: Boxes) -> Iterator[tuple[str, torch.Tensor]]:
        """A lazy source's pairs on the wire's names, each a plain tensor (its box's): a value whose box is
        not the one announced (by ``specs`` or the previous send) raises ValueError."""
        for n, value in items:
            name, shard = self._rename(n), box_of(value)
            box = (shard.global_shape, shard.offset) if shard is not None and not shard.whole else None
            if box != shards.get(name):
                said = shards.get(name)
                raise ValueError(
                    f"{name!r} is {_box_text(box)}, but it was announced as {_box_text(said)} (by specs= or "
                    "the previous send): the boxes of a lazy source must not change"
                )
            yield name, shard.tensor if shard is not None else value


def _untied(pairs: list[tuple[str, torch.Tensor]]) -> bool:
    """No two of these tensors with bytes start at one address, so none is tied to another (an empty or meta
    tensor never is: ``Manifest.build``): a manifest with no tied names describes them if their names, shapes
    and dtypes match it."""
    addresses = [t.data_ptr() for _, t in pairs if t.numel() and not t.is_meta]
    return len(set(addresses)) == len(addresses)


def in_place(items: Pairs, manifest: Manifest, delta: bool, plans: Plans) -> bool:
    """This source's tensors lie in the merged plan's layout (it may then be agreed; never with deltas,
    whose base is kept in the bucket plan's layout)."""
    if delta or not isinstance(items, list):
        return False
    if any(e.dtype != e.wire_dtype for e in manifest.entries):
        return False
    return laid_out_in_place(plans.merged(manifest), [t for _, t in items], receiving=False)


def peek_device(items: Pairs) -> tuple[Pairs, torch.device]:
    """The device the tensors live on (the first non-empty one's), without consuming a lazy source."""
    if isinstance(items, list):
        device = next((t.device for _, t in items if t.numel()), torch.device("cpu"))
        return items, device
    try:
        first = next(items)
    except StopIteration:
        return iter(()), torch.device("cpu")
    return itertools.chain([first], items), first[1].device


def _box_text(box: tuple[tuple[int, ...], tuple[int, ...]] | None) -> str:
    if box is None:
        return "a whole tensor"
    return f"a box at {list(box[1])} of a global tensor {list(box[0])}"
