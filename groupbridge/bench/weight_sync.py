"""Weight-sync benchmark: ours beside the flat-tensor ceiling, per-tensor broadcast and memcpy, same run.

Every mode runs in interleaved rounds (the order rotates each round) after one untimed round that warms
every mode up (a transport's first sync makes and maps its buffers: a one-time cost), buffers are touched
before timing, and ratios are taken per round, then the median: a shared, noisy machine drifts by more
than the effects measured.
Time is taken on the sender from the start of a mode until every receiver has its bytes (our sync ends with
the receivers' acknowledgements; the anchors end with a one-element all_reduce).
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from .._procs import publish_listener, run_roles
from ..stateless import StatelessGroup
from ..weights import WeightReceiver, WeightSender, flatten_
from ..weights.manifest import Manifest
from ..weights.plan import stream_offsets
from .models import dense_shapes, make_model, moe_shapes

__all__ = ["BenchConfig", "run_weight_sync"]

ANCHORS = ("flat", "per_tensor")


@dataclass(kw_only=True)
class BenchConfig:
    shape: str = "dense"
    """dense | moe | moe-half | tiny"""
    receivers: int = 1
    bucket_bytes: list[int] = field(default_factory=lambda: [64 << 20])
    rounds: int = 3
    modes: list[str] = field(default_factory=lambda: ["ours", "ours_flat", "flat", "per_tensor"])
    host: str = "127.0.0.1"
    transport: str = "broadcast"
    threads: int | None = 1
    """torch intra-op threads inside the sync (the library's default); None: leave torch's default."""
    timeout_s: float = 900


def shapes_for(name: str) -> list[tuple[str, tuple[int, ...]]]:
    if name == "dense":
        return dense_shapes()
    if name == "moe":
        return moe_shapes()
    if name == "moe-half":
        return moe_shapes(layers=8)
    if name == "tiny":
        return dense_shapes(scale=8, layers=4)
    raise ValueError(f"unknown shape {name!r} (dense, moe, moe-half, tiny)")


def _mode_names(cfg: BenchConfig) -> list[str]:
    names = []
    for m in cfg.modes:
        if m.startswith("ours") and len(cfg.bucket_bytes) > 1:
            names += [f"{m}@{b}" for b in cfg.bucket_bytes]
        else:
            names.append(m)
    return names


def _role(rank: int, cfg: BenchConfig, ports: Any) -> dict[str, Any]:
    n = cfg.receivers + 1
    lis, port = publish_listener(rank, n, ports, cfg.host, timeout=120)
    g = StatelessGroup.create(
        cfg.host, port, rank=rank, world_size=n, listener=lis, timeout=timedelta(seconds=cfg.timeout_s)
    )
    sealed = None  # the same ranks sealed with a token, for the "ours_sealed" mode
    if any(m.startswith("ours_sealed") for m in cfg.modes):
        lis, port = publish_listener(rank, n, ports, cfg.host, timeout=120)
        sealed = StatelessGroup.create(
            cfg.host,
            port,
            rank=rank,
            world_size=n,
            listener=lis,
            timeout=timedelta(seconds=cfg.timeout_s),
            token="bench-token",
            name="sealed",
        )
    shapes = shapes_for(cfg.shape)
    model = make_model(shapes, seed=0 if rank == 0 else 1)
    names = _mode_names(cfg)
    flat_model = shared_model = None
    if any(m.startswith(("ours_flat", "ours_shared")) for m in names):
        flat_model = {k: v.clone() for k, v in model.items()}
        flatten_(flat_model)
    if rank == 0 and any(m.startswith("ours_shared") for m in names):
        shared_model = {k: v.clone() for k, v in model.items()}
        flatten_(shared_model).share_memory_()  # type: ignore[no-untyped-call]  # as after share_memory_()
    total = stream_offsets(Manifest.build(list(model.items())))[1]
    flat = torch.ones(total, dtype=torch.uint8)
    tick = torch.zeros(1)
    memcpy_dst = torch.ones(total, dtype=torch.uint8) if rank == 0 else None
    default_bucket = cfg.bucket_bytes[0]
    senders: dict[tuple[int, bool], WeightSender] = {}
    receivers = {False: WeightReceiver(g, src=0) if rank else None}
    if sealed is not None:
        receivers[True] = WeightReceiver(sealed, src=0) if rank else None
    times: dict[str, list[float]] = {m: [] for m in [*names, "memcpy"]}
    version = 0
    for rnd in range(-1, cfg.rounds):  # round -1 warms every mode up (slots made and mapped): not timed
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for mode in order:
            base, _, bucket = mode.partition("@")
            bucket_bytes = int(bucket) if bucket else default_bucket
            version += 1
            g.barrier()
            t0 = time.perf_counter()
            if base in ("ours", "ours_flat", "ours_atomic", "ours_shared", "ours_sealed"):
                src = model if base in ("ours", "ours_atomic", "ours_sealed") else flat_model
                seal = base == "ours_sealed"
                if rank == 0 and base == "ours_shared":
                    src = shared_model
                assert src is not None
                if rank == 0:
                    if (bucket_bytes, seal) not in senders:
                        senders[(bucket_bytes, seal)] = WeightSender(
                            sealed if seal and sealed is not None else g,
                            bucket_bytes=bucket_bytes,
                            transport=cfg.transport,
                        )
                    snd = senders[(bucket_bytes, seal)]
                    snd.send(src, version=version)
                else:
                    receiver = receivers[seal]
                    assert receiver is not None
                    atomic = base in ("ours_atomic", "ours_sealed")
                    receiver.receive_into(src, atomic=atomic, allow_stale=True)
            elif base == "flat":
                g.broadcast(flat, src=0)
                g.all_reduce(tick)
            elif base == "per_tensor":
                for t in model.values():
                    g.broadcast(t, src=0)
                g.all_reduce(tick)
            else:
                raise ValueError(f"unknown mode {mode!r}")
            if rnd >= 0:
                times[mode].append(time.perf_counter() - t0)
        if rank == 0 and memcpy_dst is not None:
            t0 = time.perf_counter()
            memcpy_dst.copy_(flat)
            if rnd >= 0:
                times["memcpy"].append(time.perf_counter() - t0)
    if sealed is not None:
        sealed.close()
    g.close()
    return {
        "times": times,
        "bytes": total,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tensors": len(model),
    }


def run_weight_sync(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Run one configuration; return one record per mode (medians with min and max, ratios per round)."""
    import multiprocessing as mp

    ports = mp.get_context("spawn").Queue()
    env = {"OMP_NUM_THREADS": "1"} if cfg.threads == 1 else {}
    results = run_roles(_role, cfg.receivers + 1, (cfg, ports), cfg.timeout_s, env=env)
    sender = results[0]
    nbytes = sender["bytes"]
    times = sender["times"]
    records = []
    rss_receivers = max(r["rss_mb"] for r in results[1:])
    for mode, ts in times.items():
        gbps = [nbytes / t / 1e9 for t in ts]
        rec: dict[str, Any] = {
            "shape": cfg.shape,
            "mode": mode.partition("@")[0],
            "transport": "memcpy"
            if mode == "memcpy"
            else (cfg.transport if mode.startswith("ours") else "gloo"),
            "bucket_bytes": int(mode.partition("@")[2] or cfg.bucket_bytes[0])
            if mode.startswith("ours")
            else None,
            "receivers": cfg.receivers,
            "tensors": sender["tensors"],
            "bytes": nbytes,
            "seconds": statistics.median(ts),
            "gbps": statistics.median(gbps),
            "gbps_min": min(gbps),
            "gbps_max": max(gbps),
            "rounds": len(ts),
            "rss_sender_mb": round(sender["rss_mb"]),
            "rss_receiver_mb": round(rss_receivers),
        }
        for anchor in (*ANCHORS, "memcpy"):
            if anchor in times and anchor != mode:
                rec[f"ratio_vs_{anchor}"] = statistics.median(
                    a / t for a, t in zip(times[anchor], ts, strict=True)
                )
            elif anchor == mode:
                rec[f"ratio_vs_{anchor}"] = 1.0
            else:
                rec[f"ratio_vs_{anchor}"] = None
        records.append(rec)
    return records
