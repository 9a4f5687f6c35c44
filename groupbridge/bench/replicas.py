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
from ..net import listen
from ..stateless import StatelessGroup
from ..weights import WeightReceiver, WeightSender
from ..weights.shard import Shard
from . import netns
from .hosts import rate_bits
from .sources import _gather  # the trainers' gather onto rank 0, as the sources bench does it

__all__ = ["ReplicasConfig", "lower_bound", "run_replicas"]

TENSORS = 16


MODES = ("forwarded", "direct", "gather")


@dataclass(kw_only=True)
class ReplicasConfig:
    cases: list[tuple[int, int]]
    """(S sources, R replicas) per row."""
    rate: str = "200mbit"
    model_bytes: int = 64 << 20
    rounds: int = 2
    """Timed syncs of each mode per row, interleaved, after an untimed first of each."""
    modes: tuple[str, ...] = MODES


def _shape(cfg: ReplicasConfig) -> tuple[int, int]:
    return cfg.model_bytes // TENSORS // 4 // 1024, 1024


def _tensor(i: int, shape: tuple[int, int], version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"t{i}/{version}".encode()))
    return torch.randn(shape, generator=g)


def lower_bound(model_bytes: int, sources: int, rate_bytes: float) -> float:
    """Seconds no schedule can beat: a receiver takes the model, the sources emit it at least once."""
    return max(model_bytes, model_bytes / sources) / rate_bytes


def _role(rank: int, cfg: ReplicasConfig, s: int, r: int, hosts: list[tuple[str, str]], ports: Any) -> Any:
    netns.enter(hosts[rank][0], own_name=True)
    n = s + r
    timeout = timedelta(seconds=600)
    lis, port = publish_listener(rank, n, ports, hosts[0][1])
    g = StatelessGroup.create(hosts[0][1], port, rank=rank, world_size=n, listener=lis, timeout=timeout)
    # gather-then-send: rank 0 and the receivers on a bridge of their own (every member takes part in every
    # sync of a bridge); its port told over the first one
    gathers = "gather" in cfg.modes
    lis2 = listen(hosts[0][1], 0) if rank == 0 and gathers else None
    port2 = g.broadcast_obj(lis2.address.port if lis2 is not None else None, src=0)
    ga = None
    if gathers and (rank == 0 or rank >= s):
        ra = 0 if rank == 0 else rank - s + 1
        ga = StatelessGroup.create(hosts[0][1], port2, rank=ra, world_size=1 + r, listener=lis2,
                                   name="gathered", timeout=timeout)  # fmt: skip
    shape = _shape(cfg)
    times: dict[str, list[float]] = {m: [] for m in cfg.modes}
    exact = True
    if rank < s:
        senders = {m: WeightSender(g, forward=m == "forwarded") for m in cfg.modes if m != "gather"}
        whole = WeightSender(ga) if ga is not None else None
    else:
        rcv = WeightReceiver(g)
        rcv_a = WeightReceiver(ga) if ga is not None else None
        target = {f"t{i}": torch.zeros(shape) for i in range(TENSORS)}
    version = 0
    for rnd in range(cfg.rounds + 1):
        for mode in cfg.modes if rnd % 2 == 0 else cfg.modes[::-1]:
            version += 1
            if rank < s:  # made before the clock starts: a trainer holds its rows when it syncs
                rows = {f"t{i}": torch.chunk(_tensor(i, shape, version), s) for i in range(TENSORS)}
                held = {
                    name: Shard(parts[rank].clone(), shape, (sum(p.shape[0] for p in parts[:rank]), 0))
                    for name, parts in rows.items()
                    if rank < len(parts)
                }
            g.barrier()
            t0 = time.perf_counter()
            if rank < s:
                if mode == "gather":
                    model = _gather(g, rank, s, held, list(rows))
                    if model is not None and whole is not None:
                        whole.send(model, version=version)
                else:
                    senders[mode].send(held, version=version)
            else:
                (rcv_a if mode == "gather" else rcv).receive_into(target, atomic=True)  # type: ignore[union-attr]
            elapsed = time.perf_counter() - t0
            if rank >= s:  # checked off the clock
                exact = exact and all(
                    torch.equal(target[f"t{i}"], _tensor(i, shape, version)) for i in range(TENSORS)
                )
            if rnd:
                times[mode].append(elapsed)
    if ga is not None:
        ga.close()
    g.close()
    return {"times": times, "exact": exact}


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
            res = run_roles(_role, s + r, (cfg, s, r, hosts, mp.get_context("spawn").Queue()), timeout=3600)
        bound = lower_bound(model, s, rate)
        rec: dict[str, Any] = {"sources": s, "replicas": r, "model_bytes": model, "link_rate": cfg.rate,
                               "lower_bound_s": bound, "exact": all(m["exact"] for m in res[s:])}  # fmt: skip
        for mode in cfg.modes:  # a sync takes as long as its slowest member
            per_round = [max(m["times"][mode][k] for m in res) for k in range(cfg.rounds)]
            rec[f"{mode}_s"] = statistics.median(per_round)
            rec[f"{mode}_worst_s"] = max(per_round)
            rec[f"{mode}_x_bound"] = statistics.median(per_round) / bound
        records.append(rec)
    return records


if __name__ == "__main__":
    import sys

    rate = next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("--rate=")), "200mbit")
    rows = [a for a in sys.argv[1:] if not a.startswith("--")] or ["1x1", "2x1", "2x2", "4x4", "2x4", "4x8"]
    cases = [(int(c.split("x")[0]), int(c.split("x")[1])) for c in rows]
    for rec in run_replicas(ReplicasConfig(cases=cases, rate=rate)):
        print(
            f"S={rec['sources']} R={rec['replicas']}: bound {rec['lower_bound_s']:.2f} s, "
            + ", ".join(
                f"{m} {rec[m + '_s']:.2f} s ({rec[m + '_x_bound']:.2f}x, worst {rec[m + '_worst_s']:.2f})"
                for m in MODES
            )
            + f", exact={rec['exact']}",
            flush=True,
        )
