"""Connect a trainer (rank 0) to N inference workers with a StatelessGroup and send them weights, here.

Run:  .venv/bin/python examples/bridge_trainer_workers.py --workers 2 [--host ::1]

In a real deployment the trainer and the workers are separate jobs: the trainer calls ``gb.listen`` and
publishes ``lis.address`` (through Ray, a file, a service registry); each worker calls ``create`` with it.
Here one script spawns them so the example runs anywhere. Each step the trainer changes its model and sends
it as a new version; every worker receives it atomically into its own copy (all or nothing) and reports
whether its weights now equal the trainer's, bit for bit.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from datetime import timedelta

import torch
from torch import nn

import groupbridge as gb

STEPS = 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))


def fingerprint(model: nn.Module) -> list[float]:
    return [float(p.double().sum()) for p in model.state_dict().values()]


def worker(rank: int, world_size: int, address: str) -> None:
    model = make_model()  # the inference side's own copy (its engine's model, in real use)
    with gb.StatelessGroup.create(
        address, rank=rank, world_size=world_size, token="demo-secret", timeout=timedelta(seconds=60)
    ) as g:
        receiver = gb.WeightReceiver(g, src=0)
        for _ in range(STEPS):
            version = receiver.receive_into(model)  # atomic: the whole version lands, or none of it
            g.send_obj({"worker": rank, "version": version, "fingerprint": fingerprint(model)}, dst=0)


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
    ok = True
    try:
        with gb.StatelessGroup.create(
            None, rank=0, world_size=world_size, listener=lis, token="demo-secret",
            timeout=timedelta(seconds=60),
        ) as g:  # fmt: skip
            model = make_model()
            sender = gb.WeightSender(g)
            for step in range(1, STEPS + 1):
                with torch.no_grad():  # a training step
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.01)
                stats = sender.send(model, version=step)
                for r in range(1, world_size):
                    reply = g.recv_obj(r)
                    same = reply["version"] == step and reply["fingerprint"] == fingerprint(model)
                    ok &= same
                    print(f"step {step}: worker {reply['worker']} holds version {reply['version']}, "
                          f"{'equal to the trainer' if same else 'DIFFERENT'} ({stats.bytes / 1e6:.1f} MB, "
                          f"{stats.seconds:.3f} s, {stats.transport})")  # fmt: skip
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if not ok or any(p.exitcode != 0 for p in procs):
        raise SystemExit("a worker does not hold the trainer's weights")


if __name__ == "__main__":
    main()
