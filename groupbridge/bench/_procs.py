"""Spawned roles for the benchmark and the demo: bounded waits, every child reaped, errors carried back."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["run_roles"]


def _child(fn: Callable[..., Any], rank: int, args: tuple[Any, ...], out: Any) -> None:
    try:
        out.put((rank, True, fn(rank, *args)))
    except BaseException as e:  # carried back to the parent, which raises it
        out.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_roles(
    fn: Callable[..., Any], n: int, args: Sequence[Any], timeout: float, env: dict[str, str] | None = None
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``n`` spawned processes; return their results in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    procs = [ctx.Process(target=_child, args=(fn, r, tuple(args), out), daemon=True) for r in range(n)]
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"roles {sorted(set(range(n)) - set(results))} did not finish within {timeout:g}s"
                )
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"role(s) {dead} exited with {[procs[r].exitcode for r in dead]}"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"role {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(n)]
