"""A receive, whatever its plan: the intake's loop over what lands, the vote, the commit. Where the bytes land
and how they are taken apart is the intake's alone (:class:`._rx_whole.Fanout`, :class:`._sharded_rx.Boxes`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import NoReturn

import torch

from ..control import Deadline
from ..errors import SyncRefusedError
from ._appliers import Applier, refused
from ._rx_stream import Taker, give_up, tell_failure
from ._session import Session, vote


class Intake:
    """What one receive lands, through its applier (:mod:`._appliers`): :meth:`tensors` yields each tensor
    (its name here) once whole, and leaves in :attr:`problem` why the bytes are refused (a digest mismatch:
    this receiver's vote); anything else raises."""

    def __init__(self, applier: Applier, total: int | None = None) -> None:
        self.applier = applier
        self.total = total if total is not None else applier.total
        """The update's tensors (for the error texts)."""
        self.problem: str | None = None

    def tensors(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        raise NotImplementedError


def named(
    taker: Taker, session: Session, intake: Intake, deadline: Deadline
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """``receive()``: the (name, tensor) pairs as they become whole, then the vote and the commit, every wait
    depending on every member. A consumer that stops early fails the sync for everyone (the sources wait for
    its acknowledgement)."""
    version, group = session.header.version, taker.group
    yielded: list[str] = []

    def failed(e: BaseException) -> Exception:  # torn where a consumer took some tensors, else untouched
        return refused(version, taker.held, e, yielded, intake.total, yielded=True)

    with group.depending_on(range(group.world_size)):
        tensors = intake.tensors()
        try:
            for name, t in tensors:
                yielded.append(name)
                yield name, t
        except GeneratorExit:
            tensors.close()
            taker.memory.bases.abandon()
            tell_failure(group, RuntimeError(f"the consumer stopped after {len(yielded)} of {intake.total} "
                                             "tensors"), f"receiving version {version}")  # fmt: skip
            raise
        except BaseException as e:
            _give_up(taker, e, f"receiving version {version}", failed(e))
        _conclude(taker, session, intake, deadline, failed)


def into(taker: Taker, session: Session, intake: Intake, deadline: Deadline) -> int:
    """``receive_into``: every bucket landed, the vote, what was staged applied, the commit; returns the
    version now held."""
    version, applier = session.header.version, intake.applier
    try:
        for _ in intake.tensors():
            pass
    except BaseException as e:
        _give_up(taker, e, f"receiving version {version}", applier.failed(e, version, taker.held))
    _conclude(taker, session, intake, deadline,
              lambda e: refused(version, taker.held, e, applier.written, intake.total))  # fmt: skip
    return version


def _conclude(
    taker: Taker, session: Session, intake: Intake, deadline: Deadline,
    failed: Callable[[BaseException], Exception],
) -> None:  # fmt: skip
    """The vote (see :func:`._session.vote`; a failure raises ``failed(cause)``), what was staged applied, the
    bases kept, the commit."""
    version = session.header.version
    try:
        vote(taker.group, version, intake.problem, deadline)
    except BaseException as e:  # a refusal every member raised alike is told to nobody
        refusal = isinstance(e, SyncRefusedError)
        _give_up(taker, e, f"voting on version {version}", failed(e), tell=not refusal)
    try:
        intake.applier.commit()
    except BaseException as e:
        error = intake.applier.commit_failed(e, version, taker.held)
        _give_up(taker, e, f"applying version {version}", error)
    taker.memory.bases.commit(version)
    taker.commit(version, session.sources)


def _give_up(taker: Taker, cause: BaseException, what: str, error: Exception, tell: bool = True) -> NoReturn:
    """Nothing of this sync is kept for deltas; then :func:`._rx_stream.give_up`."""
    taker.memory.bases.abandon()
    try:
        give_up(taker.group, cause, what, error, tell)
    finally:  # no cycle through this frame (see give_up)
        del cause, error
