"""A receiver's part of a many-source sync (see :mod:`._sharded`): what it wants, where the pieces land,
the vote, the commit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..codec import dtype_from_name, dtype_name
from ..control import Deadline
from ._appliers import torn
from ._rx_stream import acknowledge, give_up, tell_failure
from ._sharded import ShardedSession, Slot, receive_shards, vote
from .shard import Box, Shard, box_of

if TYPE_CHECKING:
    from .receiver import WeightReceiver

__all__ = ["data_ptr", "shards_into", "shards_named", "wants_of"]


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


def _slot(value: Any) -> Slot:
    """Where a target holds its box of the global tensor."""
    shard = box_of(value)
    if shard is not None:
        return shard.tensor, shard.box
    return value, Box((0,) * value.dim(), tuple(value.shape))


def _land_shards(rcv: WeightReceiver, session: ShardedSession, slots: dict[str, Slot], deadline: Deadline,
                 written: list[str]) -> None:  # fmt: skip
    """Receive every source's pieces into ``slots``, then vote; raises (the peers told) on failure."""
    what = f"receiving version {session.header.version}"
    try:
        problem = receive_shards(rcv.group, session, slots, rcv._copier, rcv._buffers, deadline, written)
    except BaseException as e:
        tell_failure(rcv.group, session.sources[0], e, what)
        raise
    vote(rcv.group, session.header.version, problem, deadline)


def shards_into(
    rcv: WeightReceiver, session: ShardedSession, targets: dict[str, Any], atomic: bool, deadline: Deadline
) -> int:
    """``receive_into`` of a many-source sync: staged (atomic) or straight into the targets' boxes."""
    version = session.header.version
    dest = {wire: _slot(targets[rcv._rename(wire)]) for wire in session.plan.order}
    slots = {
        wire: (torch.empty(box.shape, dtype=dtype_from_name(session.plan.dtypes[wire])), box)
        if atomic
        else (t, box)
        for wire, (t, box) in dest.items()
    }
    written: list[str] = []
    rcv._held = None
    try:
        _land_shards(rcv, session, slots, deadline, written)
    except BaseException as e:
        if atomic or not written:
            raise
        names = [rcv._rename(w) for w in written]
        raise torn(version, rcv.version, e, names, len(dest), "some tensors were written") from e
    if atomic:

        def apply() -> None:
            with torch.no_grad():
                for wire, (staged, _) in slots.items():
                    dest[wire][0].copy_(staged)

        try:
            rcv._copier.run(apply)
        except BaseException as e:
            give_up(rcv.group, session.sources[0], e, f"applying version {version}", torn(
                version, rcv.version, e, [rcv._rename(w) for w in dest], len(dest), "every byte arrived"
            ))  # fmt: skip
    rcv.version = version
    for src in session.sources:
        acknowledge(rcv.group, src, version)
    return version


def shards_named(
    rcv: WeightReceiver, session: ShardedSession, deadline: Deadline
) -> Iterator[tuple[str, torch.Tensor]]:
    """``receive()`` of a many-source sync: whole tensors, staged, yielded once every member voted yes."""
    plan = session.plan
    slots: dict[str, Slot] = {}
    for wire in plan.order:
        shape = plan.global_shapes[wire]
        staged = torch.empty(shape, dtype=dtype_from_name(plan.dtypes[wire]), device=rcv.device)
        slots[wire] = (staged, Box((0,) * len(shape), shape))
    rcv._held = None
    _land_shards(rcv, session, slots, deadline, [])
    for wire, (t, _) in slots.items():
        yield rcv._rename(wire), t
    rcv.version = session.header.version
    for src in session.sources:
        acknowledge(rcv.group, src, session.header.version)
