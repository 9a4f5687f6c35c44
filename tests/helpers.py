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


def host_params(ipv6_slow: bool = False) -> list[Any]:
    """IPv4 and IPv6 loopback; ``ipv6_slow``: the IPv6 case runs in the slow suite (a check whose IPv6 run
    adds nothing its IPv4 run and the IPv6 runs left in ``make test`` do not already show)."""
    import pytest

    from groupbridge.doctor import has_ipv6_loopback

    marks = [pytest.mark.skipif(not has_ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")]
    if ipv6_slow:
        marks.append(pytest.mark.slow)
    return [pytest.param("127.0.0.1", id="ipv4"), pytest.param("::1", id="ipv6", marks=marks)]


share_port = publish_listener


def make_group(rank: int, n: int, host: str, ports: Any, **kwargs: Any) -> Any:
    from datetime import timedelta

    import groupbridge as gb

    lis, port = share_port(rank, n, ports, host)
    kwargs.setdefault("timeout", timedelta(seconds=30))
    return gb.StatelessGroup.create(host, port, rank=rank, world_size=n, listener=lis, **kwargs)


_POLL = {"x86_64": "7", "aarch64": "73"}  # the poll syscall's number (ppoll on aarch64)


def unobservable(pid: int) -> str | None:
    """Why :func:`wait_until_blocked` cannot watch process ``pid`` from this one (another architecture, a
    kernel without /proc's ``syscall`` file, a ptrace policy hiding a sibling's), or None when it can."""
    import platform

    if platform.machine() not in _POLL:
        return f"which syscall is poll on {platform.machine()} is not known here"
    try:
        with open(f"/proc/{pid}/task/{pid}/syscall") as f:
            f.read()
    except OSError as e:
        return f"/proc/{pid}/task/{pid}/syscall cannot be read here: {e}"
    return None


def wait_until_blocked(pid: int, *, hold: float = 0.1, timeout: float = 10.0) -> None:
    """Return once the main thread of process ``pid`` has sat in one blocking
    ``poll`` (how torch's store client waits for a reply) for ``hold`` seconds without waking: a store round
    trip lasts microseconds, so a thread that stays there that long is inside a server-side wait. So a test
    goes on once the state it sets up exists, not after a sleep that a busy machine can outlast; raises
    TimeoutError after ``timeout`` seconds. Check :func:`unobservable` first."""
    import platform
    import time

    poll = _POLL[platform.machine()]
    task = f"/proc/{pid}/task/{pid}"

    def sample() -> str | None:
        """The thread's voluntary context switches while it sleeps in poll (unchanged while it stays
        asleep), else None."""
        try:
            with open(f"{task}/syscall") as f:
                call = f.read().split()[0]
            with open(f"{task}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (FileNotFoundError, ProcessLookupError):
            raise AssertionError(f"process {pid} ended instead of waiting") from None
        if call != poll or not fields["State"].strip().startswith("S"):
            return None
        return fields["voluntary_ctxt_switches"].strip()

    first: tuple[float, str] | None = None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        now, seen = time.monotonic(), sample()
        if seen is None or first is None or first[1] != seen:
            first = None if seen is None else (now, seen)
        elif now - first[0] >= hold:
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} was not seen in one wait for {hold}s within {timeout}s")


def refused_after_takeover(send: Callable[[], Any]) -> Any:
    """A trainer's first send after another trainer took its engine over: refused in the handshake, naming
    the version the engine holds, either at once (its bridge already seen left: it joins the engine again)
    or after one send that finds the bridge left (its update names a bridge the worker is not on)."""
    import groupbridge as gb

    for attempt in range(2):
        try:
            send()
        except gb.SyncRefusedError as e:
            return e
        except gb.WeightSyncError as e:
            left = "another trainer's bridge" in str(e) or "closed the group" in str(e)
            assert attempt == 0 and left, e
    raise AssertionError("the send after a takeover was not refused")
