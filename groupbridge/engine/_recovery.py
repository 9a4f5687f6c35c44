"""What a trainer does once an update went wrong after its bytes moved, or to learn whether it did.

Three answers, each a question to the engine through its :class:`EngineControl`: which engine a dead bridge
member belongs to (so that the error names it), whether every replica serves what the trainer sent (the
probe), and, when a commit or a probe failed, rolling every replica back to the version it served before,
saying in words what the engines serve when that is not possible.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

from ..errors import PeerDiedError, VerificationError
from ._config import TrainerConfig
from ._control import EngineControl
from ._probe import Probe

__all__ = ["dead_member", "holding", "roll_back", "verify", "withhold"]

logger = logging.getLogger("groupbridge.engine._trainer")


def dead_member(error: BaseException, control: EngineControl | None, sources: int) -> tuple[int, str] | None:
    """The dead bridge member ``error`` names (a worker: ranks from ``sources`` on), and the engine it
    belongs to in words (``control.describe_rank``), or None."""
    seen: BaseException | None = error
    rank: int | None = None
    while seen is not None and rank is None:
        if isinstance(seen, PeerDiedError) and seen.rank is not None:
            if not seen.aborted:
                rank = seen.rank
            else:  # a live member aborted, having seen another stop first: that one, as its reason says
                stopped = re.search(r"rank (\d+) stopped its heartbeat", str(seen))
                rank = int(stopped.group(1)) if stopped else None
        seen = seen.__cause__ or seen.__context__
    if control is None or rank is None or rank < sources:
        return None
    described = control.describe_rank(rank - sources)
    return (rank, f"bridge rank {rank} is {described}") if described else None


def verify(
    control: EngineControl, config: TrainerConfig, probe: Probe, v: int, previous: int | None,
    seconds: dict[str, float],
) -> None:  # fmt: skip
    """Every replica scores the probe of version ``v``; one that disagrees (or a probe that fails) rolls
    every replica back to ``previous`` and raises VerificationError. ``seconds`` gains ``verify`` and
    ``unverified`` (until the engines serve a verified version again)."""
    t0 = time.perf_counter()
    # the trainer's reference is computed while the replicas score theirs (each is a forward pass)
    pool = ThreadPoolExecutor(1, thread_name_prefix="groupbridge-reference")
    try:
        expected = pool.submit(probe.expected, v)
        scores = control.probe(list(probe.tokens))
        worst = probe.worst(expected.result(timeout=config.timeout_s), scores)
    except Exception as e:
        back, now = roll_back(control, config, v, previous, probed=True)
        raise VerificationError(
            f"the probe of version {v} failed: {type(e).__name__}: {e}; {back}",
            version=v, replica=-1, difference=float("nan"), served=now,
        ) from e  # fmt: skip
    finally:
        pool.shutdown(wait=False)
    seconds["verify"] = time.perf_counter() - t0
    if worst is None:
        seconds["unverified"] = seconds["verify"]
        return
    k, diff = worst
    back, served_now = roll_back(control, config, v, previous, probed=True)
    seconds["unverified"] = time.perf_counter() - t0
    raise VerificationError(
        f"replica {k} serves version {v} with log-probabilities {diff:.4g} away from the trainer's "
        f"(atol {probe.atol:g}; {len(scores)} replica(s) probed): {back}",
        version=v, replica=k, difference=diff, served=served_now,
    )  # fmt: skip


def roll_back(
    control: EngineControl, config: TrainerConfig, v: int, previous: int | None, *, probed: bool = False
) -> tuple[str, int | None]:
    """After a failed commit or probe (``probed``) of ``v``: every replica serves ``previous`` again, where
    the workers keep it; with none to serve again, a probe's failure is withheld (:func:`withhold`). Returns
    what the engines serve now, in words, and the version every replica serves (None when that is not
    known: no rollback, or one that failed)."""
    if not config.keeps_previous:
        return f"rollback is off (TrainerConfig(rollback=True) turns it on); {holding(control)}", None
    if previous is None:
        if probed:
            return withhold(control, config, v), None
        return (
            f"no earlier version of this trainer to roll back to (its first update): the replicas serve "
            f"{v} where it was committed; send a corrected version"
        ), None
    try:
        control.rollback(previous)
    except Exception as e:
        logger.error("groupbridge: the rollback to version %d failed: %s", previous, e)
        return (
            f"the rollback to version {previous} failed too ({type(e).__name__}: {str(e)[:500]}); "
            f"{holding(control)}"
        ), None
    logger.warning("groupbridge: version %d was rolled back; every replica serves %d", v, previous)
    return f"every replica was rolled back to version {previous} and serves it", previous


def withhold(control: EngineControl, config: TrainerConfig, v: int) -> str:
    """Version ``v`` failed its probe on this trainer's first update: no engine may serve it as ``v``. Every
    engine reports it unverified and serves no request until an update lands and verifies (or serves on,
    labelled so: ``serve_unverified``). Returns what the engines do now, in words."""
    first = "no earlier version of this trainer to roll back to (its first update)"
    if not control.capabilities.withhold:
        return f"{first}: {control.describe()} cannot withhold it and serves {v} where it was committed"
    try:
        control.withhold(v, config.serve_unverified)
    except Exception as e:
        logger.error("groupbridge: withholding version %d failed: %s", v, e)
        return f"{first}; withholding it failed too ({type(e).__name__}: {str(e)[:500]}); {holding(control)}"
    if config.serve_unverified:
        logger.warning(
            "groupbridge: version %d failed its probe; the engines serve it labelled unverified", v
        )
        return f"{first}: the engines serve it on, labelled 'unverified' (serve_unverified=True)"
    logger.error("groupbridge: version %d failed its probe; the engines serve no request until the next", v)
    return (
        f"{first}: every engine stopped serving (it reports 'unverified' and fails each request with an "
        "error) until the next update lands and verifies: send a corrected version"
    )


def holding(control: EngineControl) -> str:
    """What the engines report serving now, engine by engine (asked after a commit or rollback failed),
    and what mends one left torn."""
    try:
        lines = control.holding()
    except Exception as e:
        return f"what each engine serves could not be asked ({type(e).__name__}: {str(e)[:300]})"
    return (
        "the engines report: "
        + "; ".join(lines)
        + " (a groupbridge worker loads every tensor of the next update, which mends one left torn)"
    )
