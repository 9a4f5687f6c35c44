"""What a trainer tells each inference worker so that it can join the bridge, and the bounds on waits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TIMEOUT_S = 3600.0
"""The longest an update (or a worker's join) may be allowed to take: an engine answers nothing else while a
worker waits in its RPC, so an unbounded or absurd value would stop serving without an error."""
MAX_LIVENESS_S = 300.0
SWAPS = ("shadow", "reload")


def check_seconds(**values: Any) -> None:
    """Each value is a number of seconds in (0, its maximum]: ``timeout*`` up to :data:`MAX_TIMEOUT_S`,
    ``liveness*`` up to :data:`MAX_LIVENESS_S`. Raises ValueError naming the field (inf, nan, bools and
    strings included), before anything is started or shut down."""
    for name, v in values.items():
        limit = MAX_LIVENESS_S if name.startswith("liveness") else MAX_TIMEOUT_S
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= limit:
            raise ValueError(f"{name}={v!r} must be a number of seconds in (0, {limit:g}]")


@dataclass
class BridgeInfo:
    """How a worker joins the trainer's bridge: plain JSON values, so it crosses any engine's RPC."""

    host: str
    port: int
    world_size: int
    name: str = "engine"
    generation: int = 0
    token: str | None = None
    atomic: bool = True
    timeout_s: float = 300.0
    liveness_s: float = 10.0
    sources: int = 1
    """Trainer ranks on the bridge (ranks 0 .. sources-1); the workers follow them."""
    rollback: bool = False
    """Keep the bytes of the version served before each update (one more copy of the model's wire bytes in
    host memory), so that the trainer can have it served again (see :mod:`._rollback`)."""
    swap: str = "shadow"
    """``"shadow"``: a worker whose loader keeps a second copy of its model loads each update into it
    while it serves, and the commit exchanges the copies (see ``engine.Swaps``); ``"reload"``: the commit
    loads the update into the serving copy (no second copy held)."""
    rank_offset: int = 0
    """Where this engine's workers start among the workers: with several engines on one bridge (a fleet),
    engine k's workers follow those of engines 0 .. k-1. A worker's rank is ``sources + rank_offset + its
    index in its engine``."""
    reset_versions: bool = False
    """The worker forgets the versions it passed as it joins (``TrainerConfig.reset_versions``: only on a
    trainer session's first bridge)."""
    bridge_id: str = ""
    """Drawn by the trainer for each bridge it hosts; each update names it (``WorkerSession.receive(
    bridge=)``), so that a worker another trainer has taken over refuses the first trainer's update at once
    instead of waiting on the other's bridge."""

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"port={self.port!r} is not a TCP port")
        if not isinstance(self.sources, int) or self.sources < 1:
            raise ValueError(f"sources={self.sources!r} must be >= 1 (the trainer ranks on the bridge)")
        if not isinstance(self.world_size, int) or self.world_size < self.sources + 1:
            raise ValueError(f"world_size={self.world_size!r}: the trainer ranks and at least one worker")
        if (
            isinstance(self.rank_offset, bool)
            or not isinstance(self.rank_offset, int)
            or not 0 <= self.rank_offset < self.world_size - self.sources
        ):
            raise ValueError(
                f"rank_offset={self.rank_offset!r} must be an int in [0, {self.world_size - self.sources}) "
                "(the workers of the engines before this one)"
            )
        if self.swap not in SWAPS:
            raise ValueError(f"swap={self.swap!r} must be one of {', '.join(SWAPS)}")
        check_seconds(timeout_s=self.timeout_s, liveness_s=self.liveness_s)
