"""Many sources across simulated hosts: T trainer hosts holding FSDP row shards of the dense shape, four
inference hosts as 2 replicas x tensor parallel 2 (each wants half the rows of every tensor).

Side by side in one run, interleaved by round:

- (a) today's way: the trainers gather the model onto rank 0 (over their links), which then sends it whole
  through the best single-source transport (relay, a chain through the four hosts);
- (b) many sources: every trainer sends each receiver the rows it holds that the receiver wants;
- (c) the link bound: the most bytes any one link carries in (b), at the link rate;
- (d) many sources sending deltas (``WeightSender(delta="always")``: a delta every sync, where
  ``delta=True`` would first time two full ones; on a bridge of its own so that its bases outlive the full
  syncs of (b)), after about 2 % of every source's values changed (every 50th element).

Peak memory is each trainer rank's peak resident size after the (b)-only warm-up round and after the run
(the gather of (a) holds the whole model on rank 0).
"""

from __future__ import annotations

import math
import resource
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
from ..weights import RelayOptions, WeightReceiver, WeightSender
from ..weights.shard import Shard
from . import netns
from .hosts import rate_bits
from .models import dense_shapes

__all__ = ["SourcesConfig", "run_sources"]

REPLICAS, TP = 2, 2


@dataclass(kw_only=True)
class SourcesConfig:
    sources: list[int]
    rate: str = "800mbit"
    rounds: int = 2
    scale: int = 1
    """Divides the dense shape's widths (1: the full 0.92 GiB)."""
    bucket_bytes: int = 32 << 20


def _rows(rows: int, parts: int, i: int) -> tuple[int, int]:
    """Part i of ``rows`` split as torch.chunk splits them."""
    step = -(-rows // parts)
    return min(i * step, rows), min((i + 1) * step, rows)


def _rows_of(name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of tensor ``name``, made alone (a trainer never holds more than its shard)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{lo}".encode()))
    return torch.randn((hi - lo, *shape[1:]), generator=g, dtype=torch.bfloat16)


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _role(rank: int, cfg: SourcesConfig, t: int, hosts: list[tuple[str, str]], ports: Any) -> dict[str, Any]:
    netns.enter(hosts[rank][0])
    n = t + REPLICAS * TP
    timeout = timedelta(seconds=900)
    lis, port = publish_listener(rank, n, ports, hosts[0][1])
    g = StatelessGroup.create(hosts[0][1], port, rank=rank, world_size=n, listener=lis, timeout=timeout)
    # (a) sends on a bridge of rank 0 and the inference hosts only: every member takes part in every sync
    lis2, port2 = publish_listener(rank, n, ports, hosts[0][1]) if rank == 0 or rank >= t else (None, None)
    g.barrier()
    port2 = g.broadcast_obj(port2, src=0)
    # (d) on a bridge of its own; its port told over the first one (the port queue serves one group)
    lis3 = listen(hosts[0][1], 0) if rank == 0 else None
    port3 = g.broadcast_obj(lis3.address.port if lis3 is not None else None, src=0)
    gd = StatelessGroup.create(hosts[0][1], port3, rank=rank, world_size=n, listener=lis3, name="deltas",
                               timeout=timeout)  # fmt: skip
    ga = None
    if rank == 0 or rank >= t:
        ra = 0 if rank == 0 else rank - t + 1
        ga = StatelessGroup.create(hosts[0][1], port2, rank=ra, world_size=1 + REPLICAS * TP, listener=lis2,
                                   name="gathered", timeout=timeout)  # fmt: skip
    shapes = dict(dense_shapes(cfg.scale))
    names = list(shapes)
    out: dict[str, Any] = {"a": [], "b": [], "d": []}
    if rank < t:
        shards = {}
        for name, shape in shapes.items():
            lo, hi = _rows(shape[0], t, rank)
            shards[name] = Shard(_rows_of(name, shape, lo, hi), shape, (lo,) + (0,) * (len(shape) - 1))
        # p2p, named: the simulated hosts share one kernel, where ``auto`` would find shared memory
        snd = WeightSender(g, transport="p2p", bucket_bytes=cfg.bucket_bytes)
        snd_d = WeightSender(gd, transport="p2p", bucket_bytes=cfg.bucket_bytes, delta="always")
        relay = None
        if ga is not None:
            chunks = RelayOptions(chunk_bytes=4 << 20)
            relay = WeightSender(
                ga, transport="relay", bucket_bytes=cfg.bucket_bytes, transport_options=chunks
            )
    else:
        tp = (rank - t) % TP
        halves = {}
        for name, shape in shapes.items():
            lo, hi = _rows(shape[0], TP, tp)
            local = torch.zeros((hi - lo, *shape[1:]), dtype=torch.bfloat16)
            halves[name] = Shard(local, shape, (lo,) + (0,) * (len(shape) - 1))
        whole = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        rcv = WeightReceiver(g)
        rcv_d = WeightReceiver(gd)
        rcv_a = WeightReceiver(ga) if ga is not None else None
    version = 0

    def many() -> float:
        nonlocal version
        version += 1
        g.barrier()
        t0 = time.perf_counter()
        if rank < t:
            assert snd.send(shards, version=version).transport == "p2p"
        else:
            rcv.receive_into(halves, atomic=False)
        return time.perf_counter() - t0

    step = 0

    def deltas() -> float:
        nonlocal version
        version += 1
        gd.barrier()
        t0 = time.perf_counter()
        if rank < t:
            stats = snd_d.send(shards, version=version)
            out.setdefault("changed", []).append(stats.changed_fraction)
            out.setdefault("wire", []).append(stats.wire_bytes)
        else:
            rcv_d.receive_into(halves, atomic=False)
        return time.perf_counter() - t0

    def change() -> None:
        """About 2 % of every source's values: every 50th element, another one each round."""
        nonlocal step
        step += 1
        if rank < t:
            with torch.no_grad():
                for s in shards.values():
                    s.tensor.view(-1)[step % 50 :: 50] += 1

    def gather_then_send() -> float:
        nonlocal version
        version += 1
        g.barrier()
        t0 = time.perf_counter()
        if rank < t:
            model = _gather(g, rank, t, shards, names)
            if model is not None and relay is not None:
                relay.send(model, version=version)
            del model
        else:
            assert rcv_a is not None
            rcv_a.receive_into(whole, atomic=False)
        return time.perf_counter() - t0

    many()  # warm-up: buffers made, manifests known; not timed
    out["rss_b"] = _rss_gib()
    deltas()  # the deltas' first sync is a full one: every pair's base
    out.pop("changed", None)
    out.pop("wire", None)
    for rnd in range(cfg.rounds):
        change()
        for mode in ("a", "b", "d") if rnd % 2 == 0 else ("d", "b", "a"):
            out[mode].append({"a": gather_then_send, "b": many, "d": deltas}[mode]())
    out["rss_all"] = _rss_gib()
    if ga is not None:
        ga.close()
    gd.close()
    g.close()
    return out


def _gather(
    g: StatelessGroup, rank: int, t: int, shards: dict[str, Shard], names: list[str]
) -> dict[str, torch.Tensor] | None:
    """Rank 0 receives every other trainer's rows of every tensor (the trainers' all-gather, to one rank)."""
    if rank != 0:
        for name in names:
            g.send(shards[name].tensor.contiguous(), 0)
        return None
    model = {}
    for name in names:
        s = shards[name]
        w = torch.empty(s.global_shape, dtype=s.tensor.dtype)
        w[: s.tensor.shape[0]].copy_(s.tensor)
        for src in range(1, t):
            lo, hi = _rows(w.shape[0], t, src)
            if hi > lo:
                piece = torch.empty_like(w[lo:hi])
                g.recv(piece, src)
                w[lo:hi].copy_(piece)
        model[name] = w
    return model


def run_sources(cfg: SourcesConfig) -> list[dict[str, Any]]:
    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--sources runs on simulated hosts, which are not possible here: {reason}")
    import multiprocessing as mp

    rate = rate_bits(cfg.rate) / 8
    shapes = dense_shapes(cfg.scale)
    total = sum(2 * math.prod(s) for _, s in shapes)
    records = []
    for t in cfg.sources:
        n = t + REPLICAS * TP
        with netns.SimulatedHosts(n, rate=cfg.rate) as sim:
            hosts = [(h.namespace, h.address) for h in sim.hosts]
            res = run_roles(_role, n, (cfg, t, hosts, mp.get_context("spawn").Queue()), timeout=3600)
        link = _link_bytes(shapes, t)
        a, b, d = res[0]["a"], res[0]["b"], res[0]["d"]
        records.append({
            "sources": t, "model_bytes": total, "link_rate": cfg.rate,
            "gather_then_send_s": statistics.median(a), "gather_then_send_worst_s": max(a),
            "many_sources_s": statistics.median(b), "many_sources_worst_s": max(b),
            "deltas_s": statistics.median(d), "deltas_worst_s": max(d),
            "d_over_b": statistics.median(d) / statistics.median(b),
            "deltas_changed_fraction": statistics.median(c for r in range(t) for c in res[r]["changed"]),
            "deltas_wire_bytes": sum(statistics.median(res[r]["wire"]) for r in range(t)),
            "link_bound_s": link / rate, "link_bound_bytes": link,
            "b_over_c": statistics.median(b) / (link / rate),
            "a_over_b": statistics.median(a) / statistics.median(b),
            "peak_rss_gib_rank0_b": res[0]["rss_b"], "peak_rss_gib_rank0_all": res[0]["rss_all"],
            "peak_rss_gib_trainers_b": [res[r]["rss_b"] for r in range(t)],
            "peak_rss_gib_trainers_all": [res[r]["rss_all"] for r in range(t)],
        })  # fmt: skip
    return records


def _link_bytes(shapes: list[tuple[str, tuple[int, ...]]], t: int) -> int:
    """The most bytes any one link carries in (b): per source what it sends, per receiver what it takes."""
    sent = [0] * t
    taken = [0] * TP
    for _, shape in shapes:
        row = 2 * math.prod(shape) // shape[0]
        for tp in range(TP):
            lo, hi = _rows(shape[0], TP, tp)
            taken[tp] += (hi - lo) * row
            for s in range(t):
                slo, shi = _rows(shape[0], t, s)
                sent[s] += max(0, min(hi, shi) - max(lo, slo)) * row * REPLICAS
    return max(*sent, *taken)
