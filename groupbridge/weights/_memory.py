"""What deltas need to outlive one bridge: a member's bases and the versions they hold.

A sender's base and a receiver's kept copy are what a delta is computed against; both normally live as long
as their :class:`~groupbridge.WeightSender` / :class:`~groupbridge.WeightReceiver`, that is, as long as one
group. A framework that makes a new bridge for every update (verl's checkpoint-engine manager does) would
then never send a delta. A :class:`DeltaMemory` is owned by the caller instead and handed to the sender or
receiver of each new bridge of the same member: what the last one committed is taken up by the next.

Nothing in it is trusted across bridges more than within one: a base is offered only when the other side
says it holds the same version of the same manifest (or, with many sources, of the same cut), and every
delta is checked against the source's digest of the new bytes, so a stale or foreign base makes a sync fail
its check, never land wrong. A member that lost its memory (a restarted worker, a new replica) holds no
base: its next sync is a full one (with many sources: its own pairs only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._bytes import BufferCache
from ._sharded_delta import Bases

__all__ = ["DeltaMemory"]


@dataclass(eq=False, slots=True)
class DeltaMemory:
    """One member's delta state, kept across bridges (see the module docstring). Use one per member and
    role: a sender or receiver keeps its bases in it as it goes; a sender takes its policy when made and
    writes it back when closed."""

    bases: Bases = field(default_factory=Bases)
    """Every stream's base, one per cut, with the version it holds: a source's fan-out stream and its pairs,
    a receiver's fan-out stream (its kept buffer, or its targets) and its pairs."""
    buffers: BufferCache = field(default_factory=BufferCache)
    """A receiver's buffers (its kept copy among them) when it is given no ``buffers=`` of its own."""
    policy: Any = None
    """A sender's delta policy (:class:`._delta_sync.Policy`): what it measured of the link, kept whether
    or not a base is (a framework's bridge per update would otherwise never get past its warm-up)."""

    def clear(self) -> None:
        """Forget every base: the next sync of each stream is a full one."""
        self.bases.clear()
        self.buffers.clear()
        self.policy = None
