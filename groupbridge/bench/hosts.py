"""Relay against star broadcast across simulated hosts (network namespaces, links shaped with tc).

One sender, R receivers, each on its own host; the link limit is the payload over the link rate. A star
broadcast splits the sender's link among the receivers; the relay chain carries the bytes once per link.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .._procs import publish_listener, run_roles
from ..stateless import StatelessGroup
from ..weights import RelayOptions, WeightReceiver, WeightSender
from . import netns
from .models import make_model

__all__ = ["HostsConfig", "run_hosts"]

RATES = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    for unit, scale in RATES.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use e.g. 800mbit or 1gbit")


@dataclass(kw_only=True)
class HostsConfig:
    receivers: list[int]
    rate: str = "800mbit"
    payload_bytes: int = 128 << 20
    transports: tuple[str, ...] = ("broadcast", "relay")
    rounds: int = 2
    chunk_bytes: int = RelayOptions().chunk_bytes
    """The relay chain's chunk: what a user of the relay gets (4 MiB, this bench's earlier choice, adds
    a 4 MiB chunk's time per hop: 0.17 s at 200 Mbit/s)."""
    bucket_bytes: int = 64 << 20


def _role(rank: int, cfg: HostsConfig, n: int, hosts: list[tuple[str, str]], ports: Any) -> dict[str, Any]:
    netns.enter(hosts[rank][0])
    timeout = timedelta(seconds=600)
    lis, port = publish_listener(rank, n, ports, hosts[0][1])
    g = StatelessGroup.create(hosts[0][1], port, rank=rank, world_size=n, listener=lis, timeout=timeout)
    pieces = 32
    model = make_model([(f"w{i}", (cfg.payload_bytes // pieces // 2,)) for i in range(pieces)], seed=rank)
    times: dict[str, list[float]] = {t: [] for t in cfg.transports}
    senders = {
        t: WeightSender(g, transport=t, bucket_bytes=cfg.bucket_bytes,
                        transport_options=RelayOptions(chunk_bytes=cfg.chunk_bytes))
        for t in cfg.transports
    } if rank == 0 else {}  # fmt: skip
    rcv = WeightReceiver(g, src=0) if rank else None
    version = 0
    for rnd in range(cfg.rounds):
        order = list(
            cfg.transports[rnd % len(cfg.transports) :] + cfg.transports[: rnd % len(cfg.transports)]
        )
        for t in order:
            version += 1
            g.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                senders[t].send(model, version=version)
            else:
                assert rcv is not None
                rcv.receive_into(model, atomic=False)
            times[t].append(time.perf_counter() - t0)
    g.close()
    return times


def run_hosts(cfg: HostsConfig) -> list[dict[str, Any]]:
    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--simulate-hosts is not possible here: {reason}")
    import multiprocessing as mp

    link_s = cfg.payload_bytes * 8 / rate_bits(cfg.rate)
    records: list[dict[str, Any]] = []
    base: dict[str, float] = {}
    for r in sorted(cfg.receivers):
        with netns.SimulatedHosts(r + 1, rate=cfg.rate) as sim:
            hosts = [(h.namespace, h.address) for h in sim.hosts]
            results = run_roles(
                _role, r + 1, (cfg, r + 1, hosts, mp.get_context("spawn").Queue()), timeout=1800
            )
        for t, ts in results[0].items():
            secs = statistics.median(ts)
            base.setdefault(t, secs)
            records.append({
                "shape": f"flat-{cfg.payload_bytes >> 20}MiB", "mode": "ours", "transport": t, "receivers": r,
                "bytes": cfg.payload_bytes, "seconds": secs, "gbps": cfg.payload_bytes / secs / 1e9,
                "gbps_min": cfg.payload_bytes / max(ts) / 1e9, "gbps_max": cfg.payload_bytes / min(ts) / 1e9,
                "link_rate": cfg.rate, "link_limit_s": link_s, "ratio_vs_link": secs / link_s,
                "ratio_vs_one_receiver": secs / base[t], "rounds": len(ts),
            })  # fmt: skip
    return records
