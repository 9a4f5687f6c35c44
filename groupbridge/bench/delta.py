"""Delta-sync benchmark: what a sync costs when it sends only what changed, beside a full sync, same run.

The workload is the one delta sync is for: fp32 master weights (the dense or MoE benchmark shape), one Adam
step per sync on random gradients, sent as bf16 (``wire_dtype``). A bf16 value changes only when its master
value crosses a rounding boundary, so the changed fraction follows the learning rate. For each learning rate
the trainer takes ``rounds`` steps; after every step each mode sends the same weights, in an order that
rotates per step, and the sync is timed on the sender from its start to the last acknowledgement:

- ``full``: ``WeightSender(wire_dtype=bf16)``, the model's bytes every time;
- ``delta``: ``WeightSender(wire_dtype=bf16, delta=True)``, which diffs only where that pays (its policy);
- ``delta_always``: ``delta="always"``, which diffs every sync (the cost of the diff itself).

The first two syncs of every learning rate are not timed: the first is a full one for every mode (no
receiver holds a base yet), and ``delta``'s policy decides from its second full sync on (the first is
cold). Ratios are taken per step, then the median.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from .._procs import publish_listener, run_roles
from ..stateless import StatelessGroup
from ..weights import WeightReceiver, WeightSender
from . import netns
from .weight_sync import shapes_for

__all__ = ["DeltaConfig", "run_delta"]

MODES = ("full", "delta", "delta_always")
_DELTA: dict[str, bool | str] = {"full": False, "delta": True, "delta_always": "always"}


@dataclass(kw_only=True)
class DeltaConfig:
    shape: str = "dense"
    lrs: list[float] = field(default_factory=lambda: [1e-7, 1e-6, 1e-5])
    rounds: int = 3
    """Timed steps per learning rate."""
    transport: str = "broadcast"
    receivers: int = 1
    modes: tuple[str, ...] = MODES
    hosts_rate: str | None = None
    """Put every member on its own simulated host with links at this rate (e.g. ``800mbit``)."""
    atomic: bool = True
    """Receivers use ``receive_into(atomic=True)`` (staged copy) or stream into their target."""
    timeout_s: float = 1800


def _master(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for n, s in shapes}


def _role(rank: int, cfg: DeltaConfig, hosts: list[tuple[str, str]] | None, ports: Any) -> Any:
    n = cfg.receivers + 1
    host = "127.0.0.1"
    if hosts is not None:
        netns.enter(hosts[rank][0])
        host = hosts[0][1]
    lis, port = publish_listener(rank, n, ports, host, timeout=120)
    g = StatelessGroup.create(
        host, port, rank=rank, world_size=n, listener=lis, timeout=timedelta(seconds=cfg.timeout_s)
    )
    shapes = shapes_for(cfg.shape)
    out: list[dict[str, Any]] = []
    for lr in cfg.lrs:
        if rank == 0:
            out += _send_steps(g, cfg, shapes, lr)
        else:
            _receive_steps(g, cfg, shapes)
    g.close()
    return out


def _send_steps(
    g: StatelessGroup, cfg: DeltaConfig, shapes: list[tuple[str, tuple[int, ...]]], lr: float
) -> list[dict[str, Any]]:
    master = _master(shapes, seed=0)
    params = list(master.values())
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(1)
    senders = {
        m: WeightSender(g, transport=cfg.transport, wire_dtype=torch.bfloat16,
                        delta=_DELTA[m])
        for m in cfg.modes
    }  # fmt: skip
    records = []
    for step in range(-1, cfg.rounds + 1):
        if step >= 0:  # the second warm-up sync follows a step too, as every sync of a training run does
            for p in params:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.normal_(generator=gen)
            opt.step()
        order = list(cfg.modes[step % len(cfg.modes) :] + cfg.modes[: step % len(cfg.modes)])
        for mode in order:
            g.broadcast_obj(mode, src=0)
            g.barrier()
            t0 = time.perf_counter()
            st = senders[mode].send(master, version=step + 2)
            seconds = time.perf_counter() - t0
            if step > 0:
                records.append({
                    "lr": lr, "step": step, "mode": mode, "seconds": seconds, "bytes": st.bytes,
                    "wire_bytes": st.wire_bytes, "changed_fraction": st.changed_fraction, "delta": st.delta,
                    "base_bytes": st.base_bytes,
                })  # fmt: skip
    g.broadcast_obj(None, src=0)
    for s in senders.values():
        s.close()
    return records


def _receive_steps(g: StatelessGroup, cfg: DeltaConfig, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
    receivers = {m: WeightReceiver(g, src=0) for m in cfg.modes}
    targets = {m: {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes} for m in cfg.modes}
    while (mode := g.broadcast_obj(None, src=0)) is not None:
        g.barrier()
        receivers[mode].receive_into(targets[mode], atomic=cfg.atomic)
    for r in receivers.values():
        r.close()


def _median_or_none(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_delta(cfg: DeltaConfig) -> list[dict[str, Any]]:
    """One record per (learning rate, mode): medians over the timed steps, ratios to ``full`` per step."""
    import multiprocessing as mp

    ports = mp.get_context("spawn").Queue()
    n = cfg.receivers + 1
    env = {"OMP_NUM_THREADS": "1"}
    if cfg.hosts_rate is None:
        results = run_roles(_role, n, (cfg, None, ports), cfg.timeout_s, env=env)
    else:
        reason = netns.unavailable_reason()
        if reason is not None:
            raise SystemExit(f"simulated hosts are not possible here: {reason}")
        with netns.SimulatedHosts(n, rate=cfg.hosts_rate) as sim:
            hosts = [(h.namespace, h.address) for h in sim.hosts]
            results = run_roles(_role, n, (cfg, hosts, ports), cfg.timeout_s, env=env)
    steps = results[0]
    records = []
    for lr in cfg.lrs:
        by_mode = {m: [r for r in steps if r["lr"] == lr and r["mode"] == m] for m in cfg.modes}
        full = by_mode.get("full")
        for mode, rs in by_mode.items():
            if not rs:
                continue
            rec: dict[str, Any] = {
                "shape": cfg.shape,
                "lr": lr,
                "mode": mode,
                "transport": cfg.transport,
                "link": cfg.hosts_rate or "loopback",
                "receivers": cfg.receivers,
                "bytes": rs[0]["bytes"],
                "seconds": statistics.median(r["seconds"] for r in rs),
                "changed_fraction": _median_or_none([r["changed_fraction"] for r in rs if r["delta"]]),
                "wire_fraction": statistics.median(r["wire_bytes"] / r["bytes"] for r in rs),
                "deltas": sum(r["delta"] for r in rs),
                "steps": len(rs),
                "base_bytes": rs[0]["base_bytes"],
                "ratio_vs_full": statistics.median(
                    r["seconds"] / f["seconds"] for r, f in zip(rs, full, strict=True)
                )
                if full
                else None,
            }
            records.append(rec)
    return records
