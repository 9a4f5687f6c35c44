"""The worker side's update protocol, as types: what a trainer asks of an engine's workers in one update.

An engine carries each request on its own channel (vLLM: ``update_weights`` with a JSON ``update_info``);
the request is one of five kinds, each a type here, and a worker implements :class:`UpdateWorker`, one method
per kind. :func:`parse_update` turns the wire's flat fields into one of them, refusing any mix of kinds, and
:func:`handle` calls the worker's method for it, so an engine adapter writes no flag tests of its own and a
second engine reuses the protocol as it is.

A worker's update goes: ``begin_update``, then one :class:`Receive` (bytes travel), or one of
:class:`Rollback`, :class:`Withhold` (nothing travels), optionally a :class:`Commit` naming the version the
finish must commit, then ``finish_update``. An :class:`Abandon` ends the update in progress instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..weights._header import check_version

__all__ = [
    "Abandon",
    "Commit",
    "Receive",
    "Rollback",
    "Update",
    "UpdateWorker",
    "Withhold",
    "handle",
    "parse_update",
    "update_fields",
]

MAX_IN_USE = 1 << 16
"""The most adapter names a :class:`Commit` may list."""


@dataclass(frozen=True)
class Receive:
    """Version ``version``'s bytes travel now, over bridge ``bridge`` (a worker on another refuses at once):
    the base model's, or, when ``adapter`` names one, a LoRA adapter's (its spec, read by the engine)."""

    version: int
    adapter: Mapping[str, Any] | None = None
    bridge: str | None = None


@dataclass(frozen=True)
class Commit:
    """Nothing travels: the next finish commits ``version`` only, and refuses (loading nothing) when another
    version is staged (a finish that arrives late, after a later update began). ``in_use``: the adapter
    versions the engine's unfinished requests name, kept loadable (None: the engine did not say)."""

    version: int
    in_use: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Rollback:
    """Nothing travels: ``version``, the one served before the last update (kept aside), loads again at the
    finish; an adapter's rollback withdraws that adapter's newer versions."""

    version: int
    adapter: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Withhold:
    """Nothing travels and nothing loads: ``version``, just committed, failed its probe with no earlier
    version to return to; the finish that follows ends the update with the model as it is."""

    version: int


@dataclass(frozen=True)
class Abandon:
    """Drop the update in progress (a trainer recovering an engine another left mid-update)."""


Update = Receive | Commit | Rollback | Withhold | Abandon
"""One request of a trainer to a worker."""


class UpdateWorker(Protocol):
    """A worker's side of the protocol (see the module's docstring)."""

    def begin_update(self) -> None: ...

    def receive(self, update: Receive) -> None: ...

    def expect_commit(self, update: Commit) -> None: ...

    def rollback(self, update: Rollback) -> None: ...

    def withhold(self, update: Withhold) -> None: ...

    def abandon(self, update: Abandon) -> None: ...

    def finish_update(self) -> None: ...


def handle(worker: UpdateWorker, update: Update) -> None:
    """Call ``worker``'s method for ``update``'s kind."""
    if isinstance(update, Receive):
        worker.receive(update)
    elif isinstance(update, Commit):
        worker.expect_commit(update)
    elif isinstance(update, Rollback):
        worker.rollback(update)
    elif isinstance(update, Withhold):
        worker.withhold(update)
    elif isinstance(update, Abandon):
        worker.abandon(update)
    else:
        raise TypeError(f"not an update: {update!r}")


_KINDS = ("abandon", "rollback", "commit", "withhold")


def parse_update(fields: Mapping[str, Any]) -> Update:
    """One update from the wire's flat fields: ``version``, at most one of the flags ``abandon``,
    ``rollback``, ``commit``, ``withhold`` (none: a :class:`Receive`), and what its kind takes (``adapter``,
    ``bridge``, ``in_use``). Everything is checked before anything acts on it.

    Raises:
        ValueError: a field is malformed, or the flags name more than one kind.
    """
    try:  # an engine holding a version out of range would refuse every later one
        version = check_version(fields.get("version"))
    except TypeError as e:  # what comes off the wire is a value error, whatever its type
        raise ValueError(str(e)) from e
    for flag in _KINDS:
        if not isinstance(fields.get(flag, False), bool):
            raise ValueError(f"{flag} must be a bool, got {fields.get(flag)!r}")
    kinds = [flag for flag in _KINDS if fields.get(flag, False)]
    if len(kinds) > 1:
        raise ValueError(f"an update is one kind; this one says {' and '.join(kinds)}")
    adapter = fields.get("adapter")
    if adapter is not None and not isinstance(adapter, Mapping):
        raise ValueError(f"adapter must be a mapping (the adapter's spec), got {type(adapter).__name__}")
    bridge = fields.get("bridge")
    if bridge is not None and (not isinstance(bridge, str) or len(bridge) > 64):
        raise ValueError("bridge must be a bridge id (a short string)")
    in_use = fields.get("in_use")
    if in_use is not None and (
        not isinstance(in_use, (list, tuple))
        or len(in_use) > MAX_IN_USE
        or not all(isinstance(n, str) and len(n) < 1024 for n in in_use)
    ):
        raise ValueError("in_use must be a list of adapter names")
    kind = kinds[0] if kinds else None
    if kind == "abandon":
        return Abandon()
    if kind == "commit":
        return Commit(version, tuple(in_use) if in_use is not None else None)
    if kind == "rollback":
        return Rollback(version, adapter)
    if kind == "withhold":
        return Withhold(version)
    return Receive(version, adapter, bridge)


def update_fields(update: Update) -> dict[str, Any]:
    """The wire's flat fields of ``update`` (what :func:`parse_update` reads back)."""
    if isinstance(update, Abandon):
        return {"version": 0, "abandon": True}
    if isinstance(update, Commit):
        out: dict[str, Any] = {"version": update.version, "commit": True}
        if update.in_use is not None:
            out["in_use"] = list(update.in_use)
        return out
    if isinstance(update, Rollback):
        out = {"version": update.version, "rollback": True}
        if update.adapter is not None:
            out["adapter"] = dict(update.adapter)
        return out
    if isinstance(update, Withhold):
        return {"version": update.version, "withhold": True}
    out = {"version": update.version}
    if update.adapter is not None:
        out["adapter"] = dict(update.adapter)
    if update.bridge is not None:
        out["bridge"] = update.bridge
    return out
