"""`python scripts/control_cold_path.py`: the Python a small broadcast runs, timed with cold caches.

In ``groupbridge bench --control``'s one-at-a-time measure every process has slept or waited 2 ms when its
part comes, so what it runs meets cold caches, and the store's round trips hide how long that takes. Here
two ranks make a real group, then swap their store connection for a stand-in that answers at once, flush
the caches (a pass over 8 MiB) and sleep 2 ms before each step:

- the source: from its call of ``broadcast_obj`` to its first push;
- a receiver: from its blocking pop's return (the wake) to holding the object.

Medians over ``--ops`` broadcasts, without a token and with one. To time another revision, run this file
from outside the checkout with ``PYTHONPATH`` at that revision's tree (``git worktree add``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
from torch.distributed import QueueEmptyError

from groupbridge._procs import publish_listener, run_roles

PAYLOAD = {"step": 7, "lr": 1e-6, "names": ["a", "b", "c"], "ok": True, "t": 1.0}
_junk = np.ones(8 << 20, dtype=np.uint8)


def _go_cold() -> None:
    _junk[::64] += 1
    time.sleep(0.002)


class _Answering:
    """Stands in for a store connection: pushes are kept; a wait (a blocking pop, or a wait on a key as
    earlier versions made) goes cold, and the message is there after it."""

    def __init__(self, item: bytes | None = None) -> None:
        self.item, self.at, self.woken = item, 0.0, False

    def queue_push(self, queue: str, item: bytes) -> None:
        self.at = self.at or time.perf_counter()
        self.item = item

    def wait(self, keys: list[str]) -> None:
        _go_cold()
        self.at, self.woken = time.perf_counter(), True

    def queue_pop(self, queue: str, block: bool = False) -> bytes | None:
        if block:
            self.wait([queue])
        if not self.woken:
            raise QueueEmptyError("empty")
        self.woken = False
        return self.item

    def check(self, keys: list[str]) -> bool:
        return True

    def set(self, key: str, value: Any) -> None:
        pass

    def delete_key(self, key: str) -> bool:
        return True

    def set_timeout(self, timeout: Any) -> None:
        pass

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return expected


def _role(rank: int, ports: Any, token: str | None, ops: int) -> float:
    import groupbridge as gb

    lis, port = publish_listener(rank, 2, ports, "127.0.0.1")
    g = gb.StatelessGroup.create("127.0.0.1", port, rank=rank, world_size=2, listener=lis, token=token)
    real = g.control.client.store
    times = []
    if rank == 0:
        g.control.client.store = stand_in = _Answering()
        for _ in range(ops):
            _go_cold()
            stand_in.at = 0.0
            t0 = time.perf_counter()
            g.broadcast_obj(PAYLOAD, src=0)
            times.append(stand_in.at - t0)
        g.control.client.store = real
        g.send_obj([stand_in.item, g._objects._coll_seq], 1)
    else:
        item, seq = g.recv_obj(0)  # the last broadcast, sealed and numbered as the source made it
        g.control.client.store = stand_in = _Answering(item)
        for _ in range(ops):
            g._objects._coll_seq = seq - 1  # the same broadcast, again
            assert g.broadcast_obj(None, src=0) == PAYLOAD
            times.append(time.perf_counter() - stand_in.at)
        g.control.client.store = real
    g.barrier()
    g.close()
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=300)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for token in (None, "bench"):
        source, receiver = run_roles(_role, 2, (ctx.Queue(), token, args.ops), timeout=300, context=ctx)
        print(f"{'sealed' if token else 'plain '}  source, call to first push: {source:5.1f} us   "
              f"receiver, wake to object: {receiver:5.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
