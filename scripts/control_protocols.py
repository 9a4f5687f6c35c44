"""`python scripts/control_protocols.py`: the store protocols behind a small broadcast, raw, one at a time.

Three processes on a bare torch TCPStore (served by rank 0's process, as a group's is), no groupbridge code
on the path: rank 0 stamps a small pickle and broadcasts it every 2 ms to ranks 1 and 2, which report the
delay from the stamp to holding it. What each protocol costs before any of our Python runs:

- ``vllm``: vLLM's ``StatelessProcessGroup``: an unacknowledged ``set``, receivers ``get`` (a wait, a read);
- ``bells``: ours until protocol 4: per receiver a queue push and a bell, then an acknowledging ``check``;
  receivers pop, or clear their bell, pop again, wait on the bell and pop;
- ``queues``: ours: per receiver a queue push, then an acknowledging ``check``; receivers pop, or make torch's
  blocking pop (a wait and a pop in one call); the server's registrations are cleared every 32 waits here
  (the library clears them on its watcher's connection, off the path);
- ``key``: one key per broadcast, written and acknowledged; receivers ``get``.

Protocols are run in turn, ``--rounds`` times, so a machine that drifts drifts for all. ``--pin 1,0,0``
keeps rank 0 (and the store's thread) on CPU 1 and the receivers on CPU 0: where each process runs, not the
protocol, sets most of the delay on a small virtual machine (a wake-up that crosses to an idle CPU costs
more than the rest of the broadcast).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import time
from datetime import timedelta
from typing import Any

from groupbridge._procs import run_roles
from groupbridge._torch_private import QueueEmptyError

PROTOCOLS = ("vllm", "bells", "queues", "key")
FORGET_EVERY = 32
_waits = [0]
SPACING_S = 0.002


def _send(store: Any, protocol: str, i: int, data: bytes) -> None:
    if protocol == "vllm":
        store.set(f"v/{i}", data)
    elif protocol == "key":
        store.set(f"k/{i}", data)
        store.check([f"k/{i}"])
    else:
        for r in (1, 2):
            store.queue_push(f"q/{r}", data)
            if protocol == "bells":
                store.set(f"bell/{r}", "1")
        store.check(["q/2"])


def _receive(store: Any, protocol: str, i: int, rank: int) -> bytes:
    if protocol == "vllm":
        return bytes(store.get(f"v/{i}"))
    if protocol == "key":
        return bytes(store.get(f"k/{i}"))
    if protocol == "queues":
        try:
            return bytes(store.queue_pop(f"q/{rank}", block=False))
        except Exception:  # empty: wait on the queue itself
            _waits[0] += 1
            if _waits[0] % FORGET_EVERY == 0:
                store.compare_set(f"q/{rank}", "absent", "x")
            while True:
                try:
                    return bytes(store.queue_pop(f"q/{rank}", block=True))
                except QueueEmptyError:  # a stray wake
                    pass
    while True:
        try:
            return bytes(store.queue_pop(f"q/{rank}", block=False))
        except Exception:  # empty: clear the bell, look again, then wait for the next ring
            store.delete_key(f"bell/{rank}")
            try:
                return bytes(store.queue_pop(f"q/{rank}", block=False))
            except Exception:
                store.wait([f"bell/{rank}"])


def _role(rank: int, ports: Any, barrier: Any, protocol: str, ops: int, pin: list[int] | None) -> list[float]:
    from torch.distributed import TCPStore

    if pin is not None:  # before the store starts its thread, which inherits it
        os.sched_setaffinity(0, {pin[rank]})
    server = None
    if rank == 0:
        server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
        for _ in range(2):
            ports.put(server.port)
        port = server.port
    else:
        port = ports.get(timeout=60)
    store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    barrier.wait(60)
    delays = []
    for i in range(ops):
        if rank == 0:
            time.sleep(SPACING_S)
            _send(store, protocol, i, pickle.dumps({"step": 7, "t": time.perf_counter()}))
        else:
            got = pickle.loads(_receive(store, protocol, i, rank))
            delays.append((time.perf_counter() - got["t"]) * 1e6)
    barrier.wait(60)  # the store (rank 0's) outlives every receiver's last read
    del server
    return delays


def run(protocol: str, ops: int, pin: list[int] | None = None) -> list[list[float]]:
    """Each receiver's delays (us) for one run of ``protocol``, ranks on the CPUs ``pin`` names (else where
    the scheduler puts them); the processes are reaped whatever happens."""
    ctx = mp.get_context("spawn")
    ports, barrier = ctx.Queue(), ctx.Barrier(3)
    return run_roles(_role, 3, (ports, barrier, protocol, ops, pin), timeout=120, context=ctx)[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pin", help="the CPU of ranks 0, 1 and 2, e.g. 1,0,0 (default: the scheduler's choice)")
    args = ap.parse_args()
    pin = [int(c) for c in args.pin.split(",")] if args.pin else None
    if pin is not None and len(pin) != 3:
        ap.error("--pin names three CPUs, one per rank")
    rows: dict[str, list[list[float]]] = {p: [] for p in PROTOCOLS}
    for _ in range(args.rounds):
        for protocol in PROTOCOLS:
            rows[protocol].extend(run(protocol, args.ops, pin))
    print("protocol  median delay per receiver and round (us)          worst (us)")
    for protocol, runs in rows.items():
        medians = " ".join(f"{statistics.median(d):6.1f}" for d in runs)
        print(f"{protocol:8s}  {medians}  {max(max(d) for d in runs):8.1f}")


if __name__ == "__main__":
    main()
