"""Connect a trainer (rank 0) to N inference workers with a StatelessGroup, on this machine.

Run:  .venv/bin/python examples/bridge_trainer_workers.py --workers 2 [--host ::1]

In a real deployment the trainer and the workers are separate jobs: the trainer calls ``gb.listen`` and
publishes ``lis.address`` (through Ray, a file, a service registry); each worker calls ``create`` with it.
Here one script spawns them so the example runs anywhere.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from datetime import timedelta

import torch

import groupbridge as gb


def worker(rank: int, world_size: int, address: str) -> None:
    with gb.StatelessGroup.create(address, rank=rank, world_size=world_size, token="demo-secret") as g:
        config = g.broadcast_obj(None, src=0)
        weights = torch.empty(config["numel"])
        g.broadcast(weights, src=0)
        g.send_obj({"worker": rank, "checksum": float(weights.sum())}, dst=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    world_size = args.workers + 1

    lis = gb.listen(args.host, 0)  # bound and listening now: the port is ours before anyone hears of it
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world_size, str(lis.address))) for r in range(1, world_size)]
    for p in procs:
        p.start()
    try:
        with gb.StatelessGroup.create(
            None,
            rank=0,
            world_size=world_size,
            listener=lis,
            token="demo-secret",
            timeout=timedelta(seconds=60),
        ) as g:
            weights = torch.randn(1 << 20)
            g.broadcast_obj({"numel": weights.numel()}, src=0)
            g.broadcast(weights, src=0)
            for r in range(1, world_size):
                reply = g.recv_obj(r)
                ok = reply["checksum"] == float(weights.sum())
                print(f"worker {reply['worker']}: checksum {'matches' if ok else 'DIFFERS'}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
