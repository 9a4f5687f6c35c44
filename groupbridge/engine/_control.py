"""The contract between a trainer session and an engine: its calls, and what more it declares it can do.

An engine is driven through an :class:`EngineControl` (vLLM's weight-sync client, an HTTP server's routes, an
RPC to a Ray actor). The four calls every engine has are abstract; the others (scoring a probe, serving the
previous version again, serving adapters by name, reporting the version it serves) are declared in
:attr:`EngineControl.capabilities`, so that a trainer asking for one the engine cannot honour is refused when
it starts, before any byte moves or any engine's version changes, not after a commit.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Capabilities", "EngineControl"]


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond join, begin, commit and leave."""

    probe: bool = False
    """``probe(tokens)`` scores a :class:`Probe` on every replica, through the engine's own request path."""
    rollback: bool = False
    """``rollback(version)`` serves again the version served before the last update."""
    adapters: bool = False
    """Updates may be LoRA adapters, served by name beside the base model."""
    versions: bool = False
    """``served()`` reports the version the engine serves (a new trainer's first version follows it)."""
    withhold: bool = False
    """``withhold(version, serve)`` labels the version just committed unverified (its probe failed with no
    earlier version to return to) and, unless ``serve``, stops the engine serving until an update lands."""

    def missing(self, needed: Iterable[str]) -> list[str]:
        """The ``needed`` capabilities not declared, in the order asked."""
        names = {f.name for f in fields(self)}
        unknown = [n for n in needed if n not in names]
        if unknown:
            raise ValueError(f"no such engine capability: {', '.join(unknown)} (known: {', '.join(names)})")
        return [n for n in needed if not getattr(self, n)]

    @staticmethod
    def common(each: Iterable[Capabilities]) -> Capabilities:
        """What every one of several engines can do (a fleet's)."""
        each = list(each)
        return Capabilities(**{f.name: all(getattr(c, f.name) for c in each) for f in fields(Capabilities)})


class EngineControl(abc.ABC):
    """How a trainer drives an engine's workers (each call returns once every worker returned).

    ``join(info)``: each worker joins the bridge (``info``: a :class:`BridgeInfo` as plain JSON, the worker's
    rank its own). ``begin(version)``: each worker starts an update and receives it (its handshake; then,
    atomic, its bytes land in the background). ``commit(version)``: each worker loads what it received and
    serves ``version``. ``leave()``: each worker leaves the bridge (before the trainer closes it).

    A subclass that can do more says so in :attr:`capabilities` and overrides the matching call: ``probe``
    (needed by ``TrainerConfig(verify=...)``), ``rollback`` (by ``verify`` and ``rollback=True``),
    ``served`` (``versions``), ``withhold`` (used by ``verify`` where declared). ``describe_rank`` names a
    worker in errors (default: none).
    """

    capabilities: Capabilities = Capabilities()
    """What this engine declares it can do; a class attribute, or set per instance where it depends on the
    engine behind the control (a server started without LoRA serves no adapters)."""

    @abc.abstractmethod
    def join(self, info: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def begin(self, version: int) -> None: ...

    @abc.abstractmethod
    def commit(self, version: int) -> None: ...

    @abc.abstractmethod
    def leave(self) -> None: ...

    def probe(self, tokens: list[int]) -> list[list[float]]:
        """One list of log-probabilities of ``tokens[1:]`` per replica, each from its own request path."""
        raise NotImplementedError(f"{type(self).__name__} declares no probe capability")

    def rollback(self, version: int) -> None:
        """Every worker loads ``version`` again (the one it served before its last update); the engine
        serves it."""
        raise NotImplementedError(f"{type(self).__name__} declares no rollback capability")

    def withhold(self, version: int, serve: bool) -> None:
        """``version``, just committed, failed its probe and there is no earlier version to serve again:
        every engine reports it unverified, and admits no request until an update commits (``serve``: it
        serves on, its tokens labelled unverified, never ``version``)."""
        raise NotImplementedError(f"{type(self).__name__} declares no withhold capability")

    def served(self) -> int | None:
        """The version the engine reports serving, when it is a number (None: its initial weights)."""
        return None

    def stopped(self) -> list[str]:
        """The engines behind this control that serve no request (torn, or unverified), one line each in
        words; [] where every one serves or it cannot say. The next update mends them."""
        return []

    def holding(self) -> list[str]:
        """What each engine behind this control reports it serves, in words, one line per engine: asked
        after a commit or a rollback failed, so that the error says what is served, engine by engine."""
        if not self.capabilities.versions:
            return [f"{self.describe()} cannot say what it serves (it declares no versions capability)"]
        try:
            v = self.served()
        except Exception as e:
            return [f"cannot say what it serves ({type(e).__name__}: {str(e)[:200]})"]
        return [f"version {v}" if v is not None else "no numbered version (its initial weights)"]

    def describe_rank(self, worker: int) -> str | None:
        """The ``worker``-th worker on the bridge, in words (which engine, which of its workers), or None."""
        return None

    def describe(self) -> str:
        """The engine in words, for errors."""
        return type(self).__name__

    def lacking(self, needed: Iterable[str]) -> list[str]:
        """Of ``needed``, what this engine does not declare, each in words."""
        return [f"{self.describe()} declares no {n} capability" for n in self.capabilities.missing(needed)]

    def check(self, needed: Iterable[str]) -> None:
        """Raise TypeError naming each capability of ``needed`` an engine does not declare."""
        lacking = self.lacking(needed)
        if lacking:
            raise TypeError(
                "the engine cannot honour this trainer's configuration (verify needs probe and rollback, "
                "rollback=True needs rollback, an adapter needs adapters): " + "; ".join(lacking)
            )
