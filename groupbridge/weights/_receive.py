"""A receive, whatever its plan: one loop over what lands, the vote, the commit.

Every receive runs the same steps. Its :class:`Intake` takes the streams that feed this receiver and yields
each tensor as it becomes whole; then the vote (:func:`._session.vote`); an atomic intake applies what it
staged; the delta bases it began are kept; the version moves and the sources are acknowledged
(:meth:`._rx_stream.Taker.commit`). What the plan decides, where the bytes land and how they are taken apart
(one fan-out stream cut from the manifest, or one stream per (source, receiver) pair cut by boxes), is the
intake's alone: :class:`._rx_whole.Fanout`, :class:`._sharded_rx.Boxes`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator

import torch

from ..control import Deadline
from ..errors import SyncRefusedError
from ._appliers import Applier, refused
from ._rx_stream import Taker, give_up, tell_failure
from ._session import Session, vote

__all__ = ["Intake", "into", "named"]


class Intake:
    """What one receive lands, through which applier (:mod:`._appliers`), and how its commit or failure
    reads. :meth:`tensors` receives every bucket and yields each tensor the applier hands on (its name here,
    the tensor) once it is whole; it leaves in :attr:`problem` why the bytes are refused (a digest mismatch:
    this receiver's vote), and raises on anything else."""

    def __init__(self, applier: Applier, total: int | None = None) -> None:
        self.applier = applier
        self.total = total if total is not None else applier.total
        """The update's tensors (for the error texts)."""
        self.problem: str | None = None

    def written(self) -> list[str]:
        """The target's tensors (partly) overwritten so far: a failure now leaves it torn."""
        return self.applier.written

    def tensors(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        raise NotImplementedError

    def commit(self) -> None:
        """The vote passed: apply what was staged to the target (nothing, where the bytes landed there)."""
        self.applier.commit()

    def failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        """The error of a failure before the vote (untouched, or torn where something was written)."""
        return self.applier.failed(cause, version, held)

    def commit_failed(self, cause: BaseException, version: int, held: int | None) -> Exception:
        return self.applier.commit_failed(cause, version, held)


def named(
    taker: Taker, session: Session, intake: Intake, deadline: Deadline
) -> Iterator[tuple[str, torch.Tensor]]:
    """``receive()``: the (name, tensor) pairs as they become whole; after the last, the vote and the commit;
    on any failure the peers told. A consumer that stops early fails the sync for everyone (the sources wait
    for its acknowledgement)."""
    version, group = session.header.version, taker.group
    what = f"receiving version {version}"
    yielded: list[str] = []

    def failed(e: BaseException) -> Exception:  # torn where a consumer took some tensors, else untouched
        return refused(version, taker.held, e, yielded, intake.total, yielded=True)

    tensors = intake.tensors()
    try:
        for name, t in tensors:
            yielded.append(name)
            yield name, t
    except GeneratorExit:
        tensors.close()
        taker.memory.bases.abandon()
        tell_failure(group, RuntimeError(
            f"the consumer stopped after {len(yielded)} of {intake.total} tensors"), what)  # fmt: skip
        raise
    except BaseException as e:
        taker.memory.bases.abandon()
        give_up(group, e, what, failed(e))
    _vote(taker, session, intake, deadline, failed)
    taker.memory.bases.commit(version)
    taker.commit(version, session.sources)


def into(taker: Taker, session: Session, intake: Intake, deadline: Deadline) -> int:
    """``receive_into``: every bucket landed, the vote, what was staged applied, the commit; returns the
    version now held."""
    version, group = session.header.version, taker.group
    try:
        for _ in intake.tensors():
            pass
    except BaseException as e:
        taker.memory.bases.abandon()
        give_up(group, e, f"receiving version {version}", intake.failed(e, version, taker.held))
    _vote(taker, session, intake, deadline,
          lambda e: refused(version, taker.held, e, intake.written(), intake.total))  # fmt: skip
    try:
        intake.commit()
    except BaseException as e:
        taker.memory.bases.abandon()
        give_up(group, e, f"applying version {version}", intake.commit_failed(e, version, taker.held))
    taker.memory.bases.commit(version)
    taker.commit(version, session.sources)
    return version


def _vote(
    taker: Taker, session: Session, intake: Intake, deadline: Deadline,
    failed: Callable[[BaseException], Exception],
) -> None:  # fmt: skip
    """This receiver's vote (see :func:`._session.vote`): returns when every member landed and verified its
    bytes; else raises ``failed(cause)`` (untouched or torn), the peers told, nothing kept for deltas."""
    version = session.header.version
    try:
        vote(taker.group, version, intake.problem, deadline)
    except BaseException as e:
        taker.memory.bases.abandon()
        if not isinstance(e, SyncRefusedError):  # every member raised a refusal alike; else tell them
            tell_failure(taker.group, e, f"voting on version {version}")
        if not isinstance(e, Exception):
            raise
        err = failed(e)
        try:
            raise err from e
        finally:  # no cycle through this frame (see give_up)
            del err, e
