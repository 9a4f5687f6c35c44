"""A receiver's part of a sync from one source sending whole tensors (see :mod:`._session`): the stream's
buckets (:mod:`._rx_stream`) fed to the applier of the receive mode (:mod:`._appliers`), the vote, the
commit. The part of a sync of many sources, or of boxes, is :mod:`._sharded_rx`; both borrow the
receiver's means as one :class:`._rx_stream.Taker`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..codec import dtype_from_name
from ..control import Deadline
from ..errors import WeightSyncError
from ._appliers import Applier, Ring, Scratch, Staged, Streaming, refused, run_through, torn, wire_typed
from ._rx_stream import KEPT, Taker, VerifyFailed, allocated, give_up, settle, tell_failure
from ._session import Session, merged_plan
from .manifest import Manifest
from .plan import Plan

__all__ = ["plan_of", "whole_into", "whole_named"]


def plan_of(session: Session, taker: Taker) -> Plan:
    """The session's bucket plan, the merged one when every member agreed to it (reused while the manifest
    and the bucket sizes are unchanged)."""
    if session.merged:
        return merged_plan(session.manifest)
    header = session.header
    return taker.plans.whole(session.manifest, header.bucket_bytes, header.solo_bytes)


def _namer(manifest: Manifest, rename: Callable[[str], str]) -> Callable[[int], str]:
    return lambda i: rename(manifest.entries[i].name)


def whole_named(
    taker: Taker, session: Session, deadline: Deadline, every: bool, keep: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """``receive()``: the update's (name, tensor) pairs as their buckets land (tied names right after
    their tensor; empty tensors last, on a full sync); on success the commit, on any failure the peers told.
    ``keep`` (or a source that keeps a base): views of the kept buffer; ``every=False``: a delta yields
    only the tensors it changed."""
    header, manifest = session.header, session.manifest
    entries = manifest.entries
    plan = plan_of(session, taker)
    ring = Ring(taker.buffers, taker.device)
    names = _namer(manifest, taker.rename)
    applier: Applier
    if header.keeps_base or keep:
        buffer = taker.buffers.get(KEPT, plan.total_bytes, taker.device)
        applier = Staged(buffer, plan, manifest, ring, taker.copier, names, every=every)
    else:
        applier = Scratch(plan, manifest, ring, taker.copier, names)
    aliases: dict[int, list[str]] = {}
    for i, e in enumerate(entries):
        if e.alias_of is not None:
            aliases.setdefault(manifest.sources[i], []).append(names(i))
    yielded: list[str] = []
    taker.memory.held = None
    what = f"receiving version {header.version}"
    problem: str | None = None
    try:
        for index, t in run_through(taker.streams.buckets(session, plan, applier, deadline), applier):
            for name in (names(index), *aliases.get(index, [])):
                yielded.append(name)
                yield name, t
        for i, e in enumerate(entries):  # empty tensors have no bytes in any bucket
            if e.alias_of is None and e.nbytes == 0 and every:
                t = torch.empty(e.shape, dtype=dtype_from_name(e.wire_dtype), device=taker.device)
                for name in (names(i), *aliases.get(i, [])):
                    yielded.append(name)
                    yield name, t
    except GeneratorExit:
        stopped = RuntimeError(f"the consumer stopped after {len(yielded)} of {len(entries)} tensors")
        tell_failure(taker.group, stopped, what)
        raise
    except VerifyFailed as e:
        problem = f"{e}"
    except BaseException as e:
        give_up(taker.group, e, what, torn(header.version, taker.held, e, yielded, len(entries),
                "some tensors were yielded", subject="whatever consumed them holds part of it",
                verb="yielded"))  # fmt: skip

    def failed(e: BaseException) -> Exception:
        return refused(header.version, taker.held, e, yielded, len(entries), yielded=True)

    settle(taker.group, header.version, problem, deadline, failed)
    if header.keeps_base:
        taker.memory.held = (("receive",), header.version, manifest.digest)
    taker.commit(header.version, session.sources)


def whole_into(
    taker: Taker, session: Session, targets: dict[str, torch.Tensor], atomic: bool, deadline: Deadline,
    keep: tuple[Any, ...],
) -> int:  # fmt: skip
    """``receive_into``: staged in the kept buffer and copied into ``targets`` after the vote (``atomic``),
    or written bucket by bucket into them; ``keep`` tags the base a delta may next be applied to."""
    header, manifest = session.header, session.manifest
    version = header.version
    what = f"receiving version {version}"
    plan = plan_of(session, taker)
    entries = manifest.entries
    found = [targets.get(taker.rename(e.name)) for e in entries]
    missing = [taker.rename(e.name) for e, d in zip(entries, found, strict=True) if d is None]
    if missing:  # only possible when expected= differs from the target
        err = WeightSyncError(f"target has no tensor named {', '.join(missing[:20])}")
        tell_failure(taker.group, err, what)
        raise err
    dest: list[torch.Tensor] = [d for d in found if d is not None]
    device = next((d.device for d in dest), taker.device)
    ring = Ring(taker.buffers, device)
    names = _namer(manifest, taker.rename)
    taker.memory.held = None
    applier: Applier = allocated(taker.group, what, lambda: Staged(
        taker.buffers.get(KEPT, plan.total_bytes, device),
        plan, manifest, ring, taker.copier, names, dest=dest, delta=session.delta,
    ) if atomic else Streaming(
        plan, manifest, ring, taker.copier, names, dest, taker.buffers, delta=session.delta
    ))  # fmt: skip
    problem: str | None = None
    try:
        for _ in run_through(taker.streams.buckets(session, plan, applier, deadline), applier):
            pass
    except VerifyFailed as e:
        problem = f"{e}"
    except BaseException as e:
        give_up(taker.group, e, what, applier.failed(e, version, taker.held))

    def failed(e: BaseException) -> Exception:
        return refused(version, taker.held, e, applier.written, len(entries))

    settle(taker.group, version, problem, deadline, failed)
    try:
        applier.commit()
    except BaseException as e:
        give_up(taker.group, e, f"applying version {version}",
                applier.commit_failed(e, version, taker.held))  # fmt: skip
    if header.keeps_base and (atomic or all(wire_typed(d, e) for d, e in zip(dest, entries, strict=True))):
        taker.memory.held = (keep, version, manifest.digest)
    taker.commit(version, session.sources)
    return version
