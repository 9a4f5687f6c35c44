"""The handshake and plan at many members, for real: S source processes each holding an FSDP row slice of
every one of ``tensors`` small tensors send them to R receiver processes, each wanting one of ``tp`` row
blocks (as a tensor-parallel replica's rank does), over ``p2p`` on loopback, three syncs or more.

The payload is small on purpose (about 1.4 MB in all): what this measures is the control plane and the
plan. Each member reports, per sync, its wall time and the CPU time its process spent (all of its threads),
so the worst member's CPU is the figure that carries to a cluster, where each member has its own cores
(here, 64 processes share 2 cores: wall time is mostly the members' CPU added up). The sources' tensors are
made before each sync's clock starts (a trainer's step makes them), and garbage is collected before it
starts: the garbage the step and the last check left is not the sync's (``timeit`` keeps collections out of
what it times by turning the collector off; here it stays on, and what the sync's own garbage costs counts).
The time the interpreter's garbage collector took within the sync is reported beside the worst member's
CPU (a full collection walks every object of the process, torch's included).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .._procs import publish_listener, run_roles
from ..stateless import StatelessGroup
from ..weights import WeightReceiver, WeightSender
from ..weights.shard import Shard

__all__ = ["LoopbackScaleConfig", "run_loopback_scale"]


@dataclass(kw_only=True)
class LoopbackScaleConfig:
    sources: int = 8
    receivers: int = 8
    tensors: int = 700
    tp: int = 8
    """Row blocks a receiver takes one of (receiver ``r`` takes block ``r % tp``)."""
    syncs: int = 5
    rows: int = 64
    cols: int = 8
    timeout_s: float = 900.0
    store_host: str = "process"
    """Where rank 0 serves the group's store (``StatelessGroup.create(store_host=)``): in a process of its
    own by default, so that rank 0's figure is its share of the sync and the store's is reported apart."""


def _store_cpu(group: StatelessGroup) -> float:
    """CPU seconds the group's store process has spent (every thread), 0 when the store is rank 0's thread."""
    served = group._store_process
    if served is None:
        return 0.0
    total = 0
    task = f"/proc/{served.proc.pid}/task"
    for tid in os.listdir(task):
        with open(f"{task}/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def _slice(rows: int, parts: int, i: int) -> tuple[int, int]:
    step = -(-rows // parts)  # torch.chunk's split
    lo = min(i * step, rows)
    return lo, min(lo + step, rows)


def _tensor(i: int, version: int, rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * (i + 1) + version


def _role(rank: int, cfg: LoopbackScaleConfig, ports: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    n = cfg.sources + cfg.receivers
    lis, port = publish_listener(rank, n, ports, "127.0.0.1", timeout=cfg.timeout_s)
    group = StatelessGroup.create(
        "127.0.0.1",
        port,
        rank=rank,
        world_size=n,
        listener=lis,
        timeout=timedelta(seconds=cfg.timeout_s),
        liveness_timeout=timedelta(seconds=60),
        store_host=cfg.store_host,
    )
    shape = (cfg.rows, cfg.cols)
    names = [f"layers.{i}.weight" for i in range(cfg.tensors)]
    walls, cpus, gcs, exact, stores = [], [], [], [], []
    collected = [0.0, 0.0]  # the interpreter's garbage collections during the sync, the last one's start

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collected[1] = time.thread_time()
        else:
            collected[0] += time.thread_time() - collected[1]

    gc.callbacks.append(timed)
    with group:
        if rank < cfg.sources:
            lo, hi = _slice(cfg.rows, cfg.sources, rank)
            sender = WeightSender(group, transport="p2p")
        else:
            lo, hi = _slice(cfg.rows, cfg.tp, (rank - cfg.sources) % cfg.tp)
            receiver = WeightReceiver(group)
            target = {name: Shard(torch.zeros(hi - lo, cfg.cols), shape, (lo, 0)) for name in names}
        for version in range(1, cfg.syncs + 1):
            if rank < cfg.sources:  # the trainer's step made them: not the sync's work
                held = {
                    name: Shard(_tensor(i, version, *shape)[lo:hi], shape, (lo, 0))
                    for i, name in enumerate(names)
                }
            gc.collect()  # the garbage the step and the last check left is not the sync's to collect
            group.barrier()
            collected[0] = 0.0
            store = _store_cpu(group)  # read before this member's clock starts: not the sync's work
            wall, cpu = time.perf_counter(), time.process_time()
            if rank < cfg.sources:
                sender.send(held, version=version)
            else:
                receiver.receive_into(target)
            cpus.append(time.process_time() - cpu)
            walls.append(time.perf_counter() - wall)
            stores.append(_store_cpu(group) - store)
            gcs.append(collected[0])
            if rank >= cfg.sources:
                want = {name: _tensor(i, version, *shape)[lo:hi] for i, name in enumerate(names)}
                exact.append(all(torch.equal(target[name].tensor, t) for name, t in want.items()))
        (sender if rank < cfg.sources else receiver).close()
    gc.callbacks.remove(timed)
    return {"wall_s": walls, "cpu_s": cpus, "gc_s": gcs, "exact": exact, "store_cpu_s": stores}


def run_loopback_scale(cfg: LoopbackScaleConfig) -> dict[str, Any]:
    """Per sync: the slowest member's wall time, the most CPU one member spent (and which), the most any
    member but rank 0 spent, and the CPU of the store's process (none when rank 0's process serves it)."""
    import multiprocessing as mp

    n = cfg.sources + cfg.receivers
    res = run_roles(_role, n, (cfg, mp.get_context("spawn").Queue()), timeout=cfg.timeout_s * 2, threads=1)
    return {
        "sources": cfg.sources,
        "receivers": cfg.receivers,
        "tensors": cfg.tensors,
        "wall_s": [max(r["wall_s"][k] for r in res) for k in range(cfg.syncs)],
        "cpu_s": [max(r["cpu_s"][k] for r in res) for k in range(cfg.syncs)],
        "worst_cpu_rank": [max(range(n), key=lambda m: res[m]["cpu_s"][k]) for k in range(cfg.syncs)],
        # with store_host="thread", rank 0's process also serves the group's store: the others' worst, apart
        "cpu_s_not_rank0": [max(r["cpu_s"][k] for r in res[1:]) for k in range(cfg.syncs)],
        # of the worst member's CPU, what the interpreter's garbage collector took (a full collection walks
        # every object of the process: torch's alone take tens of milliseconds)
        "gc_s": [res[max(range(n), key=lambda m: res[m]["cpu_s"][k])]["gc_s"][k] for k in range(cfg.syncs)],
        "cpu_s_median": [sorted(r["cpu_s"][k] for r in res)[n // 2] for k in range(cfg.syncs)],
        "store_cpu_s": res[0]["store_cpu_s"],
        "store_host": cfg.store_host,
        "exact": all(all(r["exact"]) for r in res[cfg.sources :]),
    }
