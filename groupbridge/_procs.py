"""Roles in child processes (demo, benchmark, chaos, tests): one way to start them, wait for them and reap.

Every wait is bounded, every child is reaped (killed if it outlives the wait), and a child's exception comes
back as text with its traceback. :func:`publish_listener` is the one way a rank-0 role binds its store
socket and tells the other roles its port: bound before anyone is told, so no port is ever guessed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.context import BaseContext
from typing import Any

__all__ = ["Roles", "publish_listener", "run_roles"]


def _child(fn: Callable[..., Any], rank: int, args: tuple[Any, ...], out: Any, threads: int | None) -> None:
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
    try:
        out.put((rank, True, fn(rank, *args)))
    except BaseException as e:  # carried back to the parent, which decides
        out.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Roles:
    """``fn(rank, *args)`` in ``n`` child processes, started now; :meth:`results` waits and always reaps.

    Args:
        context: a multiprocessing context or its name (``spawn`` by default: a child imports what it needs
            and shares nothing with the parent).
        per_rank_args: one argument tuple per rank, instead of ``args`` for all.
        env: environment variables set for the children (and restored here once they started).
        threads: torch intra-op threads in each child (``None``: leave torch's default).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        n: int,
        args: Sequence[Any] = (),
        *,
        per_rank_args: Sequence[Sequence[Any]] | None = None,
        context: BaseContext | str = "spawn",
        env: dict[str, str] | None = None,
        threads: int | None = None,
    ) -> None:
        ctx = mp.get_context(context) if isinstance(context, str) else context
        self.out = ctx.Queue()
        self.args = args  # keeps queues passed to the children alive until they have started
        self.procs: list[Any] = []
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            for r in range(n):
                a = tuple(args) if per_rank_args is None else tuple(per_rank_args[r])
                p = ctx.Process(  # type: ignore[attr-defined]
                    target=_child, args=(fn, r, a, self.out, threads), daemon=True
                )
                p.start()
                self.procs.append(p)
        except BaseException:
            self.reap()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()

    def results(self, timeout: float, expect: Sequence[int] | None = None) -> dict[int, tuple[bool, Any]]:
        """(ok, value or error text) of each rank in ``expect`` (default: all) within ``timeout`` seconds.

        Raises:
            TimeoutError: a rank did not report in time (named).
            RuntimeError: a rank died without reporting (its exit code named).
        """
        want = set(range(len(self.procs)) if expect is None else expect)
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while want - set(got):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"role(s) {sorted(want - set(got))} did not finish within {timeout:g}s"
                    )
                try:
                    rank, ok, value = self.out.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r in sorted(want - set(got)) if self.procs[r].exitcode not in (None, 0)]
                    if dead and not self._drain(got):  # a result sent just before the exit may be in flight
                        codes = [self.procs[r].exitcode for r in dead]
                        raise RuntimeError(f"role(s) {dead} exited with {codes} without a result") from None
                    continue
                got[rank] = (ok, value)
        finally:
            self.reap()
        return got

    def _drain(self, got: dict[int, tuple[bool, Any]]) -> bool:
        """Collect results still in the pipe (waiting briefly); True if any came."""
        came = False
        while True:
            try:
                rank, ok, value = self.out.get(timeout=2.0)
            except queue.Empty:
                return came
            got[rank] = (ok, value)
            came = True

    def reap(self) -> None:
        """Join every child, killing those still alive after a grace period."""
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def run_roles(
    fn: Callable[..., Any],
    n: int,
    args: Sequence[Any],
    timeout: float,
    *,
    env: dict[str, str] | None = None,
    context: BaseContext | str = "spawn",
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``n`` processes; their results in rank order, or the first failure raised
    as a RuntimeError carrying the child's traceback."""
    res = Roles(fn, n, args, context=context, env=env, threads=threads).results(timeout)
    for r in sorted(res):
        ok, value = res[r]
        if not ok:
            raise RuntimeError(f"role {r} failed: {value}")
    return [res[r][1] for r in range(n)]


def publish_listener(rank: int, n: int, ports: Any, host: str, timeout: float = 60.0) -> tuple[Any, int]:
    """Rank 0 binds a listener on ``host`` port 0 and puts its port on ``ports`` (a multiprocessing queue)
    once for each other rank; the others read it. Returns (the listener on rank 0 else None, the port)."""
    from .net import listen

    if rank == 0:
        lis = listen(host, 0)
        for _ in range(n - 1):
            ports.put(lis.port)
        return lis, lis.port
    return None, int(ports.get(timeout=timeout))
