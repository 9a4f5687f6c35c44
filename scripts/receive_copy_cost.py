"""What ``receive()`` over ``shm`` pays for yielding tensors of the receiver's own memory: buckets copied
into its ring (now) against the sender's read-only slot handed out (before; a consumer that wrote into a
yielded tensor was killed by SIGSEGV), alternated in one run. One sender, two receivers, 96 MiB in 48
tensors, 7 rounds of 5 syncs. Usage::

    .venv/bin/python scripts/receive_copy_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {f"w{i}": (512, 1024) for i in range(48)}


def role(rank: int, ports: Any) -> Any:
    import torch

    import groupbridge as gb
    from groupbridge.weights import _appliers
    from groupbridge.weights.transports import Landed, Landing
    from tests.helpers import make_group

    with make_group(rank, 3, "127.0.0.1", ports) as g:
        if rank == 0:
            model = {n: torch.randn(s) for n, s in SHAPES.items()}
            with gb.WeightSender(g, transport="shm") as snd:
                for r in range(1 + 7 * 2 * 5):
                    snd.send(model, version=r + 1)
            return None
        rcv = gb.WeightReceiver(g)
        own = _appliers.Scratch.land

        def slot(self: Any, k: int) -> Any:
            return Landed(self.ring.land(self.plan)(k).view, Landing.SCRATCH)

        times: dict[str, list[float]] = {"own ring (now)": [], "sender's slot (before)": []}
        for _ in rcv.receive():  # the first sync touches every buffer
            pass
        for _ in range(7):
            for name, land in (("own ring (now)", own), ("sender's slot (before)", slot)):
                _appliers.Scratch.land = land  # type: ignore[method-assign]
                t0 = time.perf_counter()
                for _ in range(5):
                    for _ in rcv.receive():
                        pass
                times[name].append((time.perf_counter() - t0) / 5 * 1000)
        return times


if __name__ == "__main__":
    from tests.helpers import CTX, run_ranks

    res = run_ranks(role, 3, CTX.Queue(), timeout=300)
    for rank in (1, 2):
        for name, ts in res[rank].items():
            median, worst = statistics.median(ts), max(ts)
            print(f"receiver {rank}, {name}: median {median:.1f} ms, worst {worst:.1f} ms per sync")
