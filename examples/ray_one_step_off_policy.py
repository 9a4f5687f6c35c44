"""The demo loop on Ray actors: a trainer world and an inference world, bridged, one step off-policy.

Run on this machine (starts a local Ray instance):
    .venv/bin/python examples/ray_one_step_off_policy.py --steps 5
On an existing cluster (``ray start --head`` on one node, ``ray start --address=...`` on the others):
    RAY_ADDRESS=auto python examples/ray_one_step_off_policy.py --host ""   # bind each node's own IP

Every step the trainer world (data-parallel over its actors) trains and pushes weights; the workers
receive atomically, verify them against the trainer's digest and generate greedily while the trainer
already trains the next step. Exits non-zero if any sync fails verification.
"""

from __future__ import annotations

import argparse
import os
import sys

import ray
import torch
import torch.distributed as dist
from torch import nn

import groupbridge as gb
from groupbridge import ray as gb_ray
from groupbridge.demo import SIZES, TinyLM, _batch, digest


class Trainer(gb_ray.WorldMember):
    def __init__(self, size: str) -> None:
        super().__init__()
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.size = size
        self.model = TinyLM(**SIZES[size])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.sender: gb.WeightSender | None = None

    def step(self, version: int) -> dict[str, object]:
        assert self.global_group is not None
        vocab = SIZES[self.size]["vocab"]
        tokens = _batch(vocab, torch.Generator().manual_seed(version * 100 + self.global_group.rank))
        loss = nn.functional.cross_entropy(
            self.model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1)
        )
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= self.global_group.world_size
        self.opt.step()
        if self.global_group.rank != 0:
            return {}
        grp = self.bridges["weights"]
        if self.sender is None:
            self.sender = gb.WeightSender(grp)
        stats = self.sender.send(self.model, version=version)
        grp.broadcast_obj({"version": version, "digest": digest(self.model)}, src=0)
        return {
            "loss": float(loss),
            "seconds": stats.seconds,
            "gb_per_s": stats.gb_per_s,
            "transport": stats.transport,
        }


class Worker(gb_ray.WorldMember):
    def __init__(self, size: str) -> None:
        super().__init__()
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = TinyLM(**SIZES[size]).eval()
        self.receiver: gb.WeightReceiver | None = None

    def receive_and_generate(self) -> dict[str, object]:
        grp = self.bridges["weights"]
        if self.receiver is None:
            self.receiver = gb.WeightReceiver(grp, src=0)
        version = self.receiver.receive_into(self.model, atomic=True)
        expected = grp.broadcast_obj(None, src=0)
        verified = expected["version"] == version and expected["digest"] == digest(self.model)
        tokens = self.model.generate([7, 8, 9], 5)  # with version v, while the trainer trains v + 1
        return {"version": version, "verified": verified, "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--host", default="127.0.0.1", help='address the rank-0 actors bind ("" = node IP)')
    args = parser.parse_args()
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:  # a local instance, kept on loopback
        ray.init(num_cpus=args.trainers + args.workers, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)  # fmt: skip
    host = args.host or None
    try:
        trainers = gb_ray.start_world(Trainer, args.trainers, args=(args.size,), host=host)
        workers = gb_ray.start_world(Worker, args.workers, args=(args.size,), host=host)
        print(f"trainer world {trainers.groups[0]['backend']} x{args.trainers} at {trainers.address}; "
              f"inference world x{args.workers} at {workers.address}")  # fmt: skip
        address = gb_ray.bridge(trainers.actors[0], workers.actors, name="weights", host=host)
        print(f"bridge 'weights' at {address}")
        pending = []
        for v in range(1, args.steps + 1):  # submitted ahead: workers generate v while trainers train v + 1
            pending.append(
                (
                    [t.step.remote(v) for t in trainers.actors],
                    [w.receive_and_generate.remote() for w in workers.actors],
                )
            )
        failures = 0
        for v, (tf, wf) in enumerate(pending, start=1):
            stats = ray.get(tf)[0]
            results = ray.get(wf)
            ok = all(r["verified"] and r["version"] == v for r in results)
            failures += not ok
            mark = "yes" if ok else "NO"
            print(f"step {v}: loss {stats['loss']:.3f} sync {stats['seconds']:.3f}s "
                  f"{stats['gb_per_s']:.2f} GB/s "
                  f"({stats['transport']}) verified: {mark} sample {results[0]['tokens']}")  # fmt: skip
        ray.get([a.gb_shutdown.remote() for a in trainers.actors + workers.actors])
    finally:
        ray.shutdown()
    print("all syncs verified" if failures == 0 else f"{failures} sync(s) FAILED verification")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
