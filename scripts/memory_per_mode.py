"""Host memory a receiver needs beyond its own model, per receive mode: what docs/memory.md reports.

One sender and one receiver, fresh processes for each mode (peak RSS is a high-water mark), a model of
``--mib`` MiB in 64 tensors on loopback. Each side allocates its model first and notes its peak RSS; after
three syncs (the first touches every buffer, the others reuse them) it notes it again. The difference is
what the mode costs on top of the model. Usage::

    .venv/bin/python scripts/memory_per_mode.py --mib 256
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = {
    "receive_into, atomic": {"atomic": True},
    "receive_into, streaming": {"atomic": False},
    "receive(), kept views": {"receive": True},
    "receive_into, atomic, delta": {"atomic": True, "delta": True},
    "receive_into, streaming, delta": {"atomic": False, "delta": True},
}
TENSORS = 64


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _role(rank: int, ports: Any, mib: int, transport: str, mode: dict[str, Any]) -> float:
    import torch

    import groupbridge as gb
    from groupbridge._procs import publish_listener

    torch.manual_seed(0)
    model = {f"w{i}": torch.randn(mib * (1 << 20) // 4 // TENSORS) for i in range(TENSORS)}
    before = _peak_mib()
    lis, port = publish_listener(rank, 2, ports, "127.0.0.1")
    with gb.StatelessGroup.create(
        "127.0.0.1", port, rank=rank, world_size=2, listener=lis, timeout=timedelta(seconds=120)
    ) as g:
        if rank == 0:
            snd = gb.WeightSender(g, transport=transport, delta=bool(mode.get("delta")))
            for v in range(1, 4):
                model["w0"][:16] += 1.0  # a small change each version (what a delta sends)
                snd.send(model, version=v)
        else:
            rcv = gb.WeightReceiver(g)
            for _ in range(3):
                if mode.get("receive"):
                    for _name, _t in rcv.receive(keep=True):
                        pass
                else:
                    rcv.receive_into(model, atomic=mode["atomic"])
    return _peak_mib() - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--transports", default="broadcast,shm")
    args = ap.parse_args()
    from groupbridge._procs import run_roles

    print(f"model: {args.mib} MiB in {TENSORS} fp32 tensors; MiB of peak RSS beyond the model, after 3 syncs")
    print(f"{'transport':<10} {'mode':<32} {'receiver':>9} {'sender':>7}")
    for transport in args.transports.split(","):
        for name, mode in MODES.items():
            ports = mp.get_context("spawn").Queue()
            sender, receiver = run_roles(_role, 2, (ports, args.mib, transport, mode), timeout=600)
            print(f"{transport:<10} {name:<32} {receiver:>9.0f} {sender:>7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
