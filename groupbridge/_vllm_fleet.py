"""Several vLLM engines behind one weight-sync client: a fleet of replicas the trainer updates as one.

Every worker of every engine joins one bridge (engine k's workers after those of engines 0 .. k-1), so one
sync reaches all of them and commits on all or none: each worker lands and checks its bytes while its engine
serves, every member votes, and ``update_weights`` returns on the trainer only once every worker of every
engine acknowledged. Only then is ``finish_weight_update`` called, on every engine at once: the swap.

Each call goes to every engine at once, on a thread per engine (a bridge's join and its handshake are
collectives: an engine called after another would wait for it forever), and returns when all returned;
every wait is bounded, and an error names the engines that failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._vllm_client import SyncClient, announce_adapter, prompt_logprobs, served_version, start_update
from .errors import WeightSyncError

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
    """One ``VLLMWeightSyncClient`` over several engines (offline ``LLM``s through
    :class:`groupbridge.vllm.OfflineClient`, ``vllm serve`` servers through vLLM's HTTP client, ...).

    Args:
        clients: one weight-sync client per engine.
        workers: each engine's worker processes (data parallel x tensor parallel x pipeline parallel);
            default 1 each. The trainer's ``TrainerInitInfo(workers=...)`` is their sum.
        timeout_s: the bound on each call to the engines (a vLLM call that never returns would hold the
            trainer forever).
    """

    def __init__(self, clients: Sequence[SyncClient], workers: Sequence[int] | None = None,
                 timeout_s: float = 600.0) -> None:  # fmt: skip
        if not clients:
            raise ValueError("a fleet needs at least one engine's client")
        counts = list(workers) if workers is not None else [1] * len(clients)
        if len(counts) != len(clients) or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in counts
        ):
            raise ValueError(f"workers={workers!r}: one count >= 1 per engine ({len(clients)} engines)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        seen: dict[Any, int] = {}
        for k, c in enumerate(clients):  # the same engine twice would join one bridge twice: refused now,
            key = _engine_of(c)  # not at the end of the join's timeout
            if key in seen:
                raise ValueError(
                    f"engines {seen[key]} and {k} of the fleet are one engine ({key[1]}): list it once"
                )
            seen[key] = k
        self.clients = list(clients)
        self.workers = counts
        self.timeout_s = float(timeout_s)

    @property
    def total_workers(self) -> int:
        return sum(self.workers)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every engine's workers join the bridge, each engine's at its own place among the workers."""
        sources = int(init_info.get("sources", 1))
        if init_info.get("world_size") != sources + self.total_workers:
            raise ValueError(
                f"the trainer expects {init_info.get('world_size')} bridge members; this fleet has "
                f"{sources} trainer rank(s) + {self.total_workers} workers ({self.workers} per engine): pass "
                f"TrainerInitInfo(workers={self.total_workers})"
            )
        offsets = [sum(self.workers[:k]) for k in range(len(self.clients))]
        self._each(
            "join", lambda k, c: c.init_weight_transfer_engine({**init_info, "rank_offset": offsets[k]})
        )

    def start_weight_update(self) -> None:
        """Every engine starts an update (one left mid-update by an earlier trainer is recovered first)."""
        self._each("start_weight_update", lambda k, c: start_update(c))

    def update_weights(self, update_info: Any) -> None:
        """Every engine's workers receive the update: the handshake, then the bytes (atomic: they land while
        the engines serve)."""
        self._each("update_weights", lambda k, c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Every engine loads what it staged and serves ``weight_version``: called only once every worker of
        every engine acknowledged the sync."""
        self._each("finish_weight_update", lambda k, c: c.finish_weight_update(weight_version=weight_version))

    def describe_worker(self, worker: int) -> str:
        """The ``worker``-th worker of the fleet's bridge, as engine index and its worker index."""
        for k, count in enumerate(self.workers):
            if worker < count:
                return f"engine {k}'s worker {worker} (engine {k} of {len(self.clients)} in the fleet)"
            worker -= count
        return f"no worker of this fleet (it has {self.total_workers})"

    def prompt_logprobs_each(self, tokens: list[int], model: str | None = None) -> list[list[float]]:
        """Each engine's log-probabilities of ``tokens[1:]`` (a :class:`groupbridge.engine.Probe`; ``model``:
        an adapter's served name), in engine order."""
        return self._each("prompt_logprobs", lambda k, c: prompt_logprobs(c, tokens, model))

    def announce_adapter(self, name: str, version: int, max_live: int, rolled_back: bool = False) -> None:
        """Every engine serves adapter ``name`` at ``version``: tell each (see ``announce_adapter``)."""
        self._each("announce_adapter", lambda k, c: announce_adapter(c, name, version, max_live, rolled_back))

    def served_version(self) -> int | None:
        """The highest version any engine reports serving (None: none reports a number)."""

        def each(k: int, c: SyncClient) -> int | None:
            try:
                return served_version(c)
            except Exception:  # an engine that cannot say: the others' still count
                return None

        versions = [v for v in self._each("served_version", each) if v is not None]
        return max(versions) if versions else None

    def shutdown_weight_transfer_engine(self) -> None:
        def leave(k: int, c: SyncClient) -> None:
            shutdown = getattr(c, "shutdown_weight_transfer_engine", None)
            if callable(shutdown):
                shutdown()

        self._each("shutdown_weight_transfer_engine", leave)

    def _each(self, what: str, call: Callable[[int, SyncClient], Any]) -> list[Any]:
        """``call`` on every engine at once, their results in engine order; raises naming every engine that
        failed or did not return."""
        errors: dict[int, BaseException] = {}
        results: dict[int, Any] = {}

        def run(k: int) -> None:
            try:
                results[k] = call(k, self.clients[k])
            except BaseException as e:
                errors[k] = e

        threads = [
            threading.Thread(target=run, args=(k,), name=f"groupbridge-fleet-{what}-{k}", daemon=True)
            for k in range(len(self.clients))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)  # the threads run at once: the whole call is bounded by about timeout_s
        hung = [k for k, t in enumerate(threads) if t.is_alive()]
        if not errors and not hung:
            return [results[k] for k in range(len(self.clients))]
        lines = [f"engine {k}: {type(e).__name__}: {str(e)[:500]}" for k, e in sorted(errors.items())]
        lines += [f"engine {k}: did not return within {self.timeout_s:g} s" for k in hung]
        done = [k for k in range(len(self.clients)) if k not in errors and k not in hung]
        raise WeightSyncError(
            f"{what} failed on {len(lines)} of {len(self.clients)} engines (succeeded on {done or 'none'}):\n"
            + "\n".join(lines)
        ) from next(iter(errors.values()), None)
