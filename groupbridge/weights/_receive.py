"""A receive, whatever its plan: the intake's loop over what lands (:class:`._intake.Intake`), the vote, the
commit."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import NoReturn

import torch

from ..control import Deadline
from ..errors import SyncRefusedError
from ._appliers import refused
from ._intake import Intake
from ._rx_stream import Taker, give_up, tell_failure
from ._session import Session, vote


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
