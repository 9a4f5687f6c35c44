"""Real multi-process helpers for the tests: spawned ranks, bounded waits, every child reaped."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from typing import Any

from groupbridge._procs import Roles, publish_listener, run_roles

CTX = mp.get_context("forkserver")
# Children fork from a server that imported torch once: a rank starts in milliseconds instead of the second
# an import of torch takes, which is most of the suite's time on 2 cores. Nothing in the server has run a
# torch operation or started a thread, so forking it is safe.
CTX.set_forkserver_preload(["torch", "groupbridge", "tests.helpers"])


def Ranks(fn: Callable[..., Any], n: int, args: Sequence[Any] = (), per_rank_args: Any = None) -> Roles:
    """Ranks started now from the forkserver; ``results(timeout)`` gives {rank: (ok, value or error)}."""
    return Roles(fn, n, args, per_rank_args=per_rank_args, context=CTX, threads=1)


def run_ranks(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 60) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``n`` processes; return their values, re-raising the first failure."""
    return run_roles(fn, n, args, timeout, context=CTX, threads=1)


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


share_port = publish_listener


def make_group(rank: int, n: int, host: str, ports: Any, **kwargs: Any) -> Any:
    from datetime import timedelta

    import groupbridge as gb

    lis, port = share_port(rank, n, ports, host)
    kwargs.setdefault("timeout", timedelta(seconds=30))
    return gb.StatelessGroup.create(host, port, rank=rank, world_size=n, listener=lis, **kwargs)
