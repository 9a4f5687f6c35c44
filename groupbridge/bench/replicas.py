"""Many trainer hosts into many replicas on simulated hosts: S sources holding row shards (``torch.chunk``)
of a model of 16 float32 tensors, R receivers each taking the whole model (``receive_into(...,
atomic=True)``), every member a host of its own (its network namespace and host name), every link shaped to
the same rate, the default transport; the second of two syncs is timed (the first makes buffers and teaches
manifests), on every member, and the slowest member's time is the sync's.

The anchor is the **lower bound** any schedule could reach: the larger of what one receiver must take (the
model) and what the sources must emit at least once (the model over S links), at the link rate.
"""

from __future__ import annotations

import statistics
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .._procs import publish_listener, run_roles
from ..stateless import StatelessGroup
from ..weights import WeightReceiver, WeightSender
from ..weights.shard import Shard
from . import netns
from .hosts import rate_bits

__all__ = ["ReplicasConfig", "lower_bound", "run_replicas"]

TENSORS = 16


@dataclass(kw_only=True)
class ReplicasConfig:
    cases: list[tuple[int, int]]
    """(S sources, R replicas) per row."""
    rate: str = "200mbit"
    model_bytes: int = 64 << 20
    rounds: int = 1
    """Timed syncs per row, after the untimed first."""


def _shape(cfg: ReplicasConfig) -> tuple[int, int]:
    rows = cfg.model_bytes // TENSORS // 4 // 1024
    return rows, 1024


def _tensor(i: int, shape: tuple[int, int], version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"t{i}/{version}".encode()))
    return torch.randn(shape, generator=g)


def lower_bound(model_bytes: int, sources: int, rate_bytes: float) -> float:
    """Seconds no schedule can beat: a receiver takes the model, the sources emit it at least once."""
    return max(model_bytes, model_bytes / sources) / rate_bytes


def _role(rank: int, cfg: ReplicasConfig, s: int, r: int, hosts: list[tuple[str, str]], ports: Any) -> Any:
    netns.enter(hosts[rank][0], own_name=True)
    n = s + r
    lis, port = publish_listener(rank, n, ports, hosts[0][1])
    timeout = timedelta(seconds=600)
    g = StatelessGroup.create(hosts[0][1], port, rank=rank, world_size=n, listener=lis, timeout=timeout)
    shape = _shape(cfg)
    times, exact, transport = [], True, ""
    with g:
        if rank < s:
            snd = WeightSender(g)
        else:
            rcv = WeightReceiver(g)
            target = {f"t{i}": torch.zeros(shape) for i in range(TENSORS)}
        for version in range(1, cfg.rounds + 2):
            if rank < s:
                held = {}
                for i in range(TENSORS):
                    rows = torch.chunk(_tensor(i, shape, version), s)
                    if rank < len(rows):
                        lo = sum(p.shape[0] for p in rows[:rank])
                        held[f"t{i}"] = Shard(rows[rank].clone(), shape, (lo, 0))
            g.barrier()
            t0 = time.perf_counter()
            if rank < s:
                transport = snd.send(held, version=version).transport
            else:
                rcv.receive_into(target, atomic=True)
            times.append(time.perf_counter() - t0)
            if rank >= s:
                exact = exact and all(
                    torch.equal(target[f"t{i}"], _tensor(i, shape, version)) for i in range(TENSORS)
                )
        if rank < s:
            snd.close()
        else:
            rcv.close()
    return {"times": times[1:], "exact": exact, "transport": transport}


def run_replicas(cfg: ReplicasConfig) -> list[dict[str, Any]]:
    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--replicas runs on simulated hosts, which are not possible here: {reason}")
    import multiprocessing as mp

    rate = rate_bits(cfg.rate) / 8
    rows, cols = _shape(cfg)
    model = TENSORS * rows * cols * 4
    records = []
    for s, r in cfg.cases:
        with netns.SimulatedHosts(s + r, rate=cfg.rate) as sim:
            hosts = [(h.namespace, h.address) for h in sim.hosts]
            res = run_roles(_role, s + r, (cfg, s, r, hosts, mp.get_context("spawn").Queue()), timeout=1800)
        per_round = [max(m["times"][k] for m in res) for k in range(cfg.rounds)]
        bound = lower_bound(model, s, rate)
        records.append({
            "sources": s, "replicas": r, "model_bytes": model, "link_rate": cfg.rate,
            "seconds": statistics.median(per_round), "worst_s": max(per_round),
            "lower_bound_s": bound, "x_bound": statistics.median(per_round) / bound,
            "exact": all(m["exact"] for m in res[s:]), "transport": res[0]["transport"],
        })  # fmt: skip
    return records


if __name__ == "__main__":
    import sys

    rate = next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("--rate=")), "200mbit")
    rows = [a for a in sys.argv[1:] if not a.startswith("--")] or ["1x1", "2x1", "2x2", "4x4", "2x4", "4x8"]
    cases = [(int(c.split("x")[0]), int(c.split("x")[1])) for c in rows]
    for rec in run_replicas(ReplicasConfig(cases=cases, rate=rate)):
        print(
            f"S={rec['sources']} R={rec['replicas']}: {rec['seconds']:.2f} s (worst {rec['worst_s']:.2f}), "
            f"bound {rec['lower_bound_s']:.2f} s, {rec['x_bound']:.2f}x, exact={rec['exact']}, "
            f"{rec['transport']}",
            flush=True,
        )
