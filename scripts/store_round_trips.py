"""What one request costs torch's TCPStore server (libuv), in CPU time of its own thread, by kind.

A group's control plane is requests to rank 0's store, and the store's thread runs in rank 0's process: its
CPU is rank 0's. This measures, with one client on loopback, the server thread's CPU per call of each kind
(read from /proc/self/task/*/schedstat), to show which calls cost the server a round trip: a ``set`` is not
answered (the client does not wait, so the server reads many in one wake), every answered call costs a
wake and a reply, and a blocking read (``get``, ``multi_get``, a blocking ``queue_pop``) is two round trips
(a wait, then the read).

    PYTHONPATH=. python scripts/store_round_trips.py [--ops 5000]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist


def _server_ns() -> int:
    """CPU time, in ns, of this process's store server threads (their names say ``tcpstore``)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            continue
        if "tcpstore" in name:
            total += ns
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=5000)
    n = parser.parse_args().ops
    timeout = timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout, wait_for_workers=False, use_libuv=True)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout)
    value = b"x" * 100
    client.set("k", value)

    def fill() -> None:
        for _ in range(n):
            client.queue_push("q", b"x")

    kinds: list[tuple[str, Callable[[], None] | None, Callable[[], object]]] = [
        ("set (not answered)", None, lambda: client.set("k", value)),
        ("check", None, lambda: client.check(["k"])),
        ("compare_set", None, lambda: client.compare_set("k", "absent", "y")),
        ("get (wait + get)", None, lambda: client.get("k")),
        ("multi_get of one key", None, lambda: client.multi_get(["k"])),
        ("queue_push", None, lambda: client.queue_push("q", b"x")),
        ("queue_pop, blocking", None, lambda: client.queue_pop("q", block=True)),
        ("queue_pop, non-blocking", fill, lambda: client.queue_pop("q", block=False)),
    ]
    print(f"{'call':<26} server CPU per call, us ({n} calls, one client, loopback)")
    for name, before, call in kinds:
        if before is not None:
            before()
        t0 = _server_ns()
        for _ in range(n):
            call()
        print(f"{name:<26} {(_server_ns() - t0) / n / 1e3:6.1f}")


if __name__ == "__main__":
    main()
