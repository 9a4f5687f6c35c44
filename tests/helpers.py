"""Real multi-process helpers for the tests: spawned ranks, bounded waits, every child reaped."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable, Sequence
from typing import Any

CTX = mp.get_context("forkserver")
# Children fork from a server that imported torch once: a rank starts in milliseconds instead of the second
# an import of torch takes, which is most of the suite's time on 2 cores. Nothing in the server has run a
# torch operation or started a thread, so forking it is safe.
CTX.set_forkserver_preload(["torch", "groupbridge", "tests.helpers"])


def _child(fn: Callable[..., Any], rank: int, args: tuple[Any, ...], out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        out.put((rank, "ok", fn(rank, *args)))
    except BaseException as e:  # report everything to the parent, which decides
        out.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


class Ranks:
    """Processes started together; ``results()`` waits (bounded) and always reaps."""

    def __init__(self, fn: Callable[..., Any], n: int, args: Sequence[Any] = (), per_rank_args: Any = None):
        self.out = CTX.Queue()
        self.args = args  # keeps queues passed to the children alive until they have started
        self.procs = []
        for r in range(n):
            a = tuple(args) if per_rank_args is None else tuple(per_rank_args[r])
            p = CTX.Process(target=_child, args=(fn, r, a, self.out), daemon=True)
            p.start()
            self.procs.append(p)

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()

    def results(self, timeout: float, expect: Sequence[int] | None = None) -> dict[int, tuple[str, Any]]:
        """Collect (status, value) per rank from ``expect`` (default all), within ``timeout`` seconds."""
        want = set(range(len(self.procs)) if expect is None else expect)
        got: dict[int, tuple[str, Any]] = {}
        try:
            import time

            deadline = time.monotonic() + timeout
            while want - set(got):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"ranks {sorted(want - set(got))} did not finish within {timeout}s")
                try:
                    rank, status, value = self.out.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
                got[rank] = (status, value)
        finally:
            self.reap()
        return got

    def reap(self) -> None:
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def run_ranks(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 60) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``n`` processes; return their values, re-raising the first failure."""
    res = Ranks(fn, n, args).results(timeout)
    for r in sorted(res):
        status, value = res[r]
        if status != "ok":
            raise AssertionError(f"rank {r} failed: {value[0]}: {value[1]}\n{value[2]}")
    return [res[r][1] for r in range(n)]


def host_params() -> list[Any]:
    import pytest

    from groupbridge.doctor import has_ipv6_loopback

    return [
        pytest.param("127.0.0.1", id="ipv4"),
        pytest.param(
            "::1",
            id="ipv6",
            marks=pytest.mark.skipif(not has_ipv6_loopback(), reason="this host has no IPv6 loopback (::1)"),
        ),
    ]


def share_port(rank: int, n: int, ports: Any, host: str) -> tuple[Any, int]:
    """Rank 0 binds a port-0 listener and tells the others its port through ``ports`` (a Queue)."""
    import groupbridge as gb

    if rank == 0:
        lis = gb.listen(host, 0)
        for _ in range(n - 1):
            ports.put(lis.port)
        return lis, lis.port
    return None, int(ports.get(timeout=30))


def make_group(rank: int, n: int, host: str, ports: Any, **kwargs: Any) -> Any:
    from datetime import timedelta

    import groupbridge as gb

    lis, port = share_port(rank, n, ports, host)
    kwargs.setdefault("timeout", timedelta(seconds=30))
    return gb.StatelessGroup.create(host, port, rank=rank, world_size=n, listener=lis, **kwargs)
