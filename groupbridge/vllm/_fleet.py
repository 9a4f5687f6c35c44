"""Several vLLM engines updated as one: their weight-sync clients, handed to the trainer as one client.

The trainer drives them as a :class:`groupbridge.engine.Fleet` of one :class:`VllmControl` per engine (every
worker of every engine on one bridge, one commit for all, every call to the engines bounded by one
``timeout_s``); this class only holds the engines and says how many workers each has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..engine import Fleet
from ._control import SyncClient, VllmControl

__all__ = ["FleetClient"]


def _engine_of(client: Any) -> tuple[str, Any]:
    """Which engine a client drives, as far as it says: its offline ``LLM``, its server's address, or
    itself."""
    llm = getattr(client, "llm", None)
    if llm is not None:
        return ("llm", f"offline LLM at 0x{id(llm):x}")
    url = getattr(client, "base_url", None)
    if isinstance(url, str) and url:
        return ("url", url.rstrip("/"))
    return ("client", f"{type(client).__name__} at 0x{id(client):x}")


class FleetClient:
    """Several engines' weight-sync clients (offline ``LLM``s through :class:`groupbridge.vllm.OfflineClient`,
    ``vllm serve`` servers through vLLM's HTTP client, ...), passed as ``trainer_init``'s ``client``.

    Args:
        clients: one weight-sync client per engine.
        workers: each engine's worker processes (data parallel x tensor parallel x pipeline parallel);
            default 1 each. The trainer's ``TrainerInitInfo(workers=...)`` is their sum.
        timeout_s: the bound on each call to the engines, all of them together (a vLLM call that never
            returns would hold the trainer forever).
    """

    def __init__(
        self, clients: Sequence[SyncClient], workers: Sequence[int] | None = None, timeout_s: float = 600.0
    ) -> None:
        if not clients:
            raise ValueError("a fleet needs at least one engine's client")
        seen: dict[Any, int] = {}
        for k, c in enumerate(clients):  # the same engine twice would join one bridge twice: refused now,
            key = _engine_of(c)  # not at the end of the join's timeout
            if key in seen:
                raise ValueError(
                    f"engines {seen[key]} and {k} of the fleet are one engine ({key[1]}): list it once"
                )
            seen[key] = k
        self.clients = list(clients)
        self.workers = list(workers) if workers is not None else [1] * len(self.clients)
        self.timeout_s = timeout_s
        self.control(None)  # the counts and the bound, checked now

    @property
    def total_workers(self) -> int:
        return sum(self.workers)

    def control(self, update_info: Callable[[], dict[str, Any]] | None) -> Fleet:
        """The trainer's control of these engines (``update_info``: what each update tells the workers)."""
        controls = [VllmControl(c, update_info=update_info) for c in self.clients]
        return Fleet(controls, self.workers, self.timeout_s)
