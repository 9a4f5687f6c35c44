"""Many sources on one host: T trainer ranks holding FSDP row shards of the dense shape send to R receivers
that take every tensor whole, over shared memory (each receiver maps each source's ring) against over
point to point (loopback TCP through the group's send/recv), interleaved by round in one run.

The anchor is the physical limit on this host: one process copying the bytes every receiver takes
(``R`` x the model) with memcpy, measured in the same run.

Then one more sync over shared memory from a lazy source: each source yields its ``gb.Shard``s one at a time,
made as it goes (as a trainer converting per parameter would), and reports the most resident memory the
send added (peak minus the resident size before it; Linux's VmHWM, reset just before), beside its shard's
size (what converting everything first would hold) and the bucket size.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .._procs import publish_listener, run_roles
from ..stateless import StatelessGroup
from ..weights import WeightReceiver, WeightSender
from ..weights.shard import Shard
from .models import dense_shapes
from .sources import _rows, _rows_of

__all__ = ["LocalSourcesConfig", "run_local_sources"]

TRANSPORTS = ("shm", "p2p")


@dataclass(kw_only=True)
class LocalSourcesConfig:
    sources: int = 4
    receivers: int = 2
    rounds: int = 3
    scale: int = 1
    """Divides the dense shape's widths (1: the full 0.92 GiB)."""
    bucket_bytes: int = 32 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start VmHWM over from the resident size now (Linux: writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _role(rank: int, cfg: LocalSourcesConfig, ports: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    n = cfg.sources + cfg.receivers
    lis, port = publish_listener(rank, n, ports, "127.0.0.1")
    g = StatelessGroup.create("127.0.0.1", port, rank=rank, world_size=n, listener=lis,
                              timeout=timedelta(seconds=900))  # fmt: skip
    shapes = dict(dense_shapes(cfg.scale))
    out: dict[str, Any] = {k: [] for k in TRANSPORTS}
    if rank < cfg.sources:
        shards = {}
        for name, shape in shapes.items():
            lo, hi = _rows(shape[0], cfg.sources, rank)
            shards[name] = Shard(_rows_of(name, shape, lo, hi), shape, (lo,) + (0,) * (len(shape) - 1))
        senders = {k: WeightSender(g, transport=k, bucket_bytes=cfg.bucket_bytes) for k in TRANSPORTS}
    else:
        whole = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        rcv = WeightReceiver(g)
    version = 0

    def sync(kind: str) -> float:
        nonlocal version
        version += 1
        g.barrier()
        t0 = time.perf_counter()
        if rank < cfg.sources:
            stats = senders[kind].send(shards, version=version)
            assert stats.transport == kind, stats.transport
        else:
            rcv.receive_into(whole, atomic=True)
        return time.perf_counter() - t0

    for kind in TRANSPORTS:  # warm-up: buffers made and touched, manifests known; not timed
        sync(kind)
    for rnd in range(cfg.rounds):
        for kind in TRANSPORTS if rnd % 2 == 0 else TRANSPORTS[::-1]:
            out[kind].append(sync(kind))
    # a lazy source: boxes made one at a time as the buckets need them, the manifest from the last send
    version += 1
    g.barrier()
    if rank < cfg.sources:
        shard_bytes = sum(s.tensor.nbytes for s in shards.values())
        del shards

        def lazy() -> Any:
            for name, shape in shapes.items():
                lo, hi = _rows(shape[0], cfg.sources, rank)
                yield name, Shard(_rows_of(name, shape, lo, hi), shape, (lo,) + (0,) * (len(shape) - 1))

        before = _status_kib("VmRSS")
        _reset_peak()
        senders["shm"].send(lazy(), version=version)
        out["lazy_extra_mib"] = (_status_kib("VmHWM") - before) / 1024
        out["shard_mib"] = shard_bytes / 2**20
        for s in senders.values():
            s.close()
    else:
        rcv.receive_into(whole, atomic=True)
        rcv.close()
    g.close()
    return out


def _memcpy_s(nbytes: int, rounds: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def run_local_sources(cfg: LocalSourcesConfig) -> dict[str, Any]:
    import multiprocessing as mp

    shapes = dense_shapes(cfg.scale)
    total = sum(2 * math.prod(s) for _, s in shapes)
    n = cfg.sources + cfg.receivers
    res = run_roles(_role, n, (cfg, mp.get_context("spawn").Queue()), timeout=3600)
    copy_s = _memcpy_s(total * cfg.receivers, 3)
    record: dict[str, Any] = {
        "sources": cfg.sources, "receivers": cfg.receivers, "model_bytes": total,
        "memcpy_s": copy_s, "rounds": cfg.rounds,
    }  # fmt: skip
    for kind in TRANSPORTS:
        # a sync ends when its slowest receiver committed
        per_round = [max(res[r][kind][i] for r in range(cfg.sources, n)) for i in range(cfg.rounds)]
        record[f"{kind}_s"] = statistics.median(per_round)
        record[f"{kind}_worst_s"] = max(per_round)
        record[f"{kind}_vs_memcpy"] = copy_s / statistics.median(per_round)
    record["shm_over_p2p"] = record["p2p_s"] / record["shm_s"]
    record["lazy_extra_mib"] = [res[r]["lazy_extra_mib"] for r in range(cfg.sources)]
    record["shard_mib"] = [res[r]["shard_mib"] for r in range(cfg.sources)]
    record["bucket_mib"] = cfg.bucket_bytes / 2**20
    return record
