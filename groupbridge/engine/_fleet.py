"""Several engines behind one control: a fleet of replicas the trainer updates as one.

Every worker of every engine joins one bridge (engine k's workers after those of engines 0 .. k-1), so one
sync reaches all of them and commits on all or none: each worker lands and checks its bytes while its engine
serves, every member votes, and the trainer's send returns only once every worker of every engine
acknowledged. Only then is ``commit`` called, on every engine at once: the swap.

Each call goes to every engine at once, on a thread per engine (a bridge's join and its handshake are
collectives: an engine called after another would wait for it forever), and returns when all returned. The
whole call, not each engine's, is bounded by ``timeout_s``; an error names every engine that failed or did
not answer. The engines may be of any kind: a fleet needs only their :class:`EngineControl`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import WeightSyncError
from ._control import Capabilities, EngineControl

__all__ = ["Fleet"]


class Fleet(EngineControl):
    """One :class:`EngineControl` over several engines' controls.

    Args:
        controls: one control per engine.
        workers: each engine's worker processes on the bridge (default 1 each); the trainer's
            ``TrainerConfig(workers=...)`` is their sum (:attr:`total_workers`).
        timeout_s: the bound on each call to the fleet, all engines together (an engine that never returns
            would hold the trainer forever).

    Its capabilities are those every engine declares.
    """

    def __init__(
        self,
        controls: Sequence[EngineControl],
        workers: Sequence[int] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if not controls:
            raise ValueError("a fleet needs at least one engine's control")
        for k, c in enumerate(controls):
            if not isinstance(c, EngineControl):
                raise TypeError(f"engine {k} of the fleet is a {type(c).__name__}, not an EngineControl")
        counts = list(workers) if workers is not None else [1] * len(controls)
        if len(counts) != len(controls) or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in counts
        ):
            raise ValueError(f"workers={workers!r}: one count >= 1 per engine ({len(controls)} engines)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self.controls = list(controls)
        self.workers = counts
        self.timeout_s = float(timeout_s)
        self.capabilities = Capabilities.common(c.capabilities for c in self.controls)
        self._late: dict[int, tuple[str, threading.Thread]] = {}
        """Per engine, its last call when that call outlived its bound (what it was, its thread)."""

    @property
    def total_workers(self) -> int:
        return sum(self.workers)

    def join(self, info: dict[str, Any]) -> None:
        """Every engine's workers join the bridge, each engine's at its own place among the workers."""
        sources = int(info.get("sources", 1))
        if info.get("world_size") != sources + self.total_workers:
            raise ValueError(
                f"the trainer expects {info.get('world_size')} bridge members; this fleet has {sources} "
                f"trainer rank(s) + {self.total_workers} workers ({self.workers} per engine): pass "
                f"workers={self.total_workers}"
            )
        offsets = [sum(self.workers[:k]) for k in range(len(self.controls))]
        self._each("join", lambda k, c: c.join({**info, "rank_offset": offsets[k]}))

    def begin(self, version: int) -> None:
        self._each("begin", lambda k, c: c.begin(version))

    def commit(self, version: int) -> None:
        """Every engine loads what it staged and serves ``version``: called only once every worker of every
        engine acknowledged the sync."""
        self._each("commit", lambda k, c: c.commit(version))

    def leave(self) -> None:
        self._each("leave", lambda k, c: c.leave())

    def probe(self, tokens: list[int]) -> list[list[float]]:
        """Every replica's scores, in engine order."""
        return [s for each in self._each("probe", lambda k, c: c.probe(tokens)) for s in each]

    def rollback(self, version: int) -> None:
        self._each("rollback", lambda k, c: c.rollback(version))

    def withhold(self, version: int, serve: bool) -> None:
        """Every engine: a fleet commits as one, and a version that failed its probe is no one's."""
        self._each("withhold", lambda k, c: c.withhold(version, serve))

    def stopped(self) -> list[str]:
        return [f"engine {k}: {line}" for k, c in enumerate(self.controls) for line in c.stopped()]

    def served(self) -> int | None:
        """The highest version any engine reports serving (None: none reports a number)."""

        def each(k: int, c: EngineControl) -> int | None:
            try:
                return c.served()
            except Exception:  # an engine that cannot say: the others' still count
                return None

        versions = [v for v in self._each("served", each) if v is not None]
        return max(versions) if versions else None

    def holding(self) -> list[str]:
        """Each engine's line, in engine order, named by its index in the fleet. An engine whose earlier
        call outlived its bound is asked once that call returned (within this call's bound: what it holds
        after it, a late commit included), else its line says the call still runs."""
        out = []
        for k, got in enumerate(self._each("holding", lambda k, c: c.holding(), settle=True)):
            if isinstance(got, BaseException):
                out.append(f"engine {k}: cannot say what it serves ({type(got).__name__}: {str(got)[:300]})")
            else:
                out += [f"engine {k}: {line}" for line in got]
        return out

    def describe_rank(self, worker: int) -> str | None:
        """The ``worker``-th worker of the fleet's bridge, as engine index and its worker index."""
        for k, count in enumerate(self.workers):
            if worker < count:
                inner = self.controls[k].describe_rank(worker)
                own = f"engine {k}'s worker {worker} (engine {k} of {len(self.controls)} in the fleet)"
                return f"{own}: {inner}" if inner else own
            worker -= count
        return f"no worker of this fleet (it has {self.total_workers})"

    def lacking(self, needed: Iterable[str]) -> list[str]:
        needed = list(needed)
        return [f"engine {k} ({line})" for k, c in enumerate(self.controls) for line in c.lacking(needed)]

    def _each(
        self, what: str, call: Callable[[int, EngineControl], Any], *, settle: bool = False
    ) -> list[Any]:
        """``call`` on every engine at once, their results in engine order; raises, within ``timeout_s`` of
        the start, naming every engine that failed or did not return (``settle``: returns what each raised,
        or a TimeoutError for one that did not return, in its place instead).

        An engine's calls are ordered: one whose earlier call outlived its bound (and may still land, a
        late finish among them) gets this call only once that one returned, waiting within this call's
        bound; if it has not returned by then, this call is not made on that engine, and the error says so."""
        errors: dict[int, BaseException] = {}
        results: dict[int, Any] = {}
        end = time.monotonic() + self.timeout_s

        def run(k: int) -> None:
            try:
                late = self._late.get(k)
                if late is not None:
                    late[1].join(max(0.0, end - time.monotonic()))
                    if late[1].is_alive():
                        raise WeightSyncError(
                            f"its {late[0]} of an earlier call is still running: this {what} was not sent "
                            "(an engine's calls land in the order they were made)"
                        )
                results[k] = call(k, self.controls[k])
            except BaseException as e:
                errors[k] = e

        threads = [
            threading.Thread(target=run, args=(k,), name=f"groupbridge-fleet-{what}-{k}", daemon=True)
            for k in range(len(self.controls))
        ]
        for t in threads:
            t.start()
        for t in threads:  # one deadline for all: the call is bounded by timeout_s, not engines x timeout_s
            t.join(max(0.0, end - time.monotonic()))
        hung = [k for k, t in enumerate(threads) if t.is_alive()]
        for k, t in enumerate(threads):
            if k in hung:
                self._late[k] = (f"{what} (still running after {self.timeout_s:g} s)", t)
            else:
                self._late.pop(k, None)
        if settle:
            late = TimeoutError(f"its {what} did not return within {self.timeout_s:g} s")
            return [results[k] if k in results else errors.get(k, late) for k in range(len(self.controls))]
        if not errors and not hung:
            return [results[k] for k in range(len(self.controls))]
        lines = [f"engine {k}: {type(e).__name__}: {str(e)[:500]}" for k, e in sorted(errors.items())]
        lines += [f"engine {k}: did not return within {self.timeout_s:g} s" for k in hung]
        done = [k for k in range(len(self.controls)) if k not in errors and k not in hung]
        n = len(self.controls)
        raise WeightSyncError(
            f"{what} failed on {len(lines)} of {n} engines (succeeded on {done or 'none'}):\n"
            + "\n".join(lines)
        ) from next(iter(errors.values()), None)
