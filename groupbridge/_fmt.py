"""How errors write durations and rank lists, the same everywhere."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

__all__ = ["ranks", "seconds"]


def seconds(t: timedelta) -> str:
    return f"{t.total_seconds():g}s"


def ranks(members: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(members)) or "none"
