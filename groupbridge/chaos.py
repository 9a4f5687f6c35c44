"""Chaos: a sender and receivers syncing in a loop while members are killed or frozen at random moments.

Each episode makes a fresh group of one sender and ``receivers`` receivers (real processes), syncs
versions 1, 2, 3 ... over one transport (broadcast, shm or relay, in turn) with atomic receives, and injects
one fault at a random moment: SIGKILL of a random member, SIGSTOP past the liveness timeout then SIGCONT, or
none. The runner then checks what the library promises:

- every surviving member raises (or, with no fault, finishes) within the liveness timeout plus a few
  seconds of the fault: the *detection latency* is measured from the fault to the member's error;
- no receiver holds a torn model: after any failure its target equals exactly the version it reports;
- nothing is left behind: no groupbridge file in /dev/shm.

``groupbridge chaos --minutes N`` runs it for N minutes with a table; the test suite runs a short, seeded
episode set.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ._procs import Roles, publish_listener

__all__ = ["ChaosReport", "run_chaos"]

FAULTS = ("none", "kill", "stop")
TRANSPORTS = ("broadcast", "shm", "relay")
NET_FAULTS = ("cut", "loss")
"""On simulated hosts (root): a member's link unplugged past the liveness timeout, then plugged back; and
lossy links for a whole episode (queues that drop what overflows them; no other fault: every sync must
still end, bounded, and nobody may be declared dead)."""
LIVENESS_S = 2.0
SLACK_S = 6.0
"""Detection must happen within the liveness timeout plus this (the bound the library promises)."""


def _member(
    rank: int, n: int, transport: str, ports: Any, out: Any, stop: Any, hosts: list[tuple[str, str]] | None
) -> None:
    import torch

    import groupbridge as gb

    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "syncs": 0, "error": None, "t_error": None}
    try:
        host = "127.0.0.1"
        if hosts is not None:  # a simulated host of its own; rank 0's address is the store's
            from .bench import netns

            netns.enter(hosts[rank][0])
            host = hosts[0][1]
        lis, port = publish_listener(rank, n, ports, host)
        g = gb.StatelessGroup.create(
            host, port, rank=rank, world_size=n, listener=lis, timeout=timedelta(seconds=60),
            liveness_timeout=timedelta(seconds=LIVENESS_S),
        )  # fmt: skip
        out.put(("ready", rank, os.getpid()))
        names = [f"layers.{i}.weight" for i in range(24)]
        if rank == 0:
            with gb.WeightSender(g, bucket_bytes=1 << 20, transport=transport) as snd:
                v = 0
                while not stop.is_set():
                    v += 1
                    snd.send({k: torch.full((1 << 16,), float(v)) for k in names}, version=v)
                    result["syncs"] = v
        else:
            target = {k: torch.zeros(1 << 16) for k in names}
            with gb.WeightReceiver(g, src=0) as rcv:
                try:
                    while True:
                        rcv.receive_into(target, atomic=True)
                        result["syncs"] = rcv.version
                finally:
                    held = rcv.version or 0
                    result["torn"] = not all(bool((t == float(held)).all()) for t in target.values())
        g.close()
    except BaseException as e:  # every outcome is reported to the runner
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["t_error"] = time.monotonic()
    out.put(("done", rank, result))


@dataclass
class Episode:
    transport: str
    fault: str
    victim: int | None
    latencies: list[float] = field(default_factory=list)
    torn: int = 0
    syncs: int = 0
    unbounded: list[str] = field(default_factory=list)
    errors: int = 0
    """Members that raised in an episode without a fault (under packet loss: false alarms)."""
    dropped: float | None = None
    """The share of packets the lossy links dropped (loss episodes)."""


@dataclass
class ChaosReport:
    episodes: list[Episode] = field(default_factory=list)
    leaked_shm: int = 0

    def by_fault(self) -> dict[str, list[Episode]]:
        out: dict[str, list[Episode]] = {}
        for e in self.episodes:
            out.setdefault(e.fault, []).append(e)
        return out

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for fault, eps in sorted(self.by_fault().items()):
            lat = [x for e in eps for x in e.latencies]
            rows.append({
                "fault": fault,
                "episodes": len(eps),
                "syncs": sum(e.syncs for e in eps),
                "detect_median_s": round(statistics.median(lat), 2) if lat else None,
                "detect_max_s": round(max(lat), 2) if lat else None,
                "torn": sum(e.torn for e in eps),
                "unbounded": sum(len(e.unbounded) for e in eps),
                "errors_without_fault": sum(e.errors for e in eps),
            })  # fmt: skip
        return rows

    @property
    def ok(self) -> bool:
        return self.leaked_shm == 0 and all(e.torn == 0 and not e.unbounded for e in self.episodes)


def _shm_files() -> int:
    try:
        return sum(1 for n in os.listdir("/dev/shm") if "groupbridge" in n)
    except FileNotFoundError:
        return 0


def run_episode(rng: random.Random, receivers: int, transport: str, fault: str, hosts: Any = None) -> Episode:
    """One episode: members sync in a loop, ``fault`` lands at a random moment, every promise is checked.
    ``hosts`` (a :class:`~groupbridge.bench.netns.SimulatedHosts` of ``receivers + 1``) puts each member on
    a host of its own; the network faults need it."""
    n = receivers + 1
    ctx = mp.get_context("spawn")
    ports, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    run_s = 3.0
    where = [(h.namespace, h.address) for h in hosts.hosts] if hosts is not None else None
    members = Roles(_member, n, (n, transport, ports, out, stop, where), context=ctx)
    quiet = fault in ("none", "loss")
    victim = rng.randrange(n) if not quiet else None
    ep = Episode(transport, fault, victim)
    results: dict[int, dict[str, Any]] = {}
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        while len(pids) < n and time.monotonic() < deadline:
            kind, rank, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            if kind == "ready":
                pids[rank] = value
            else:
                results[rank] = value
        if fault == "loss":
            hosts.lossy()
        time.sleep(rng.uniform(0.3, 1.5))  # the fault lands at a random point of a sync
        t_fault = time.monotonic()
        if fault == "kill" and victim is not None:
            os.kill(pids[victim], signal.SIGKILL)
        elif fault == "stop" and victim is not None:
            os.kill(pids[victim], signal.SIGSTOP)
        elif fault == "cut" and victim is not None:
            hosts.cut(victim)
        expect = [r for r in range(n) if not (fault == "kill" and r == victim)]
        if quiet:  # the sender stops after run_s and closes; receivers then see it close
            time.sleep(run_s)
            stop.set()
        wait_until = time.monotonic() + LIVENESS_S + SLACK_S + 30
        resumed = False

        def resume() -> None:
            if fault == "stop":
                os.kill(pids[victim], signal.SIGCONT)  # type: ignore[index]
            elif fault == "cut":
                hosts.cut(victim, down=False)

        while any(r not in results for r in expect) and time.monotonic() < wait_until:
            if not resumed and time.monotonic() - t_fault > LIVENESS_S + 2:
                resume()
                resumed = True
            try:
                kind, rank, value = out.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == "done":
                results[rank] = value
        if not resumed:
            resume()
        if fault == "loss":
            dropped, sent = hosts.drops()
            ep.dropped = dropped / max(1, dropped + sent)
        for r in expect:
            res = results.get(r)
            if res is None:
                ep.unbounded.append(f"rank {r} never finished")
                continue
            ep.syncs = max(ep.syncs, int(res.get("syncs") or 0))
            ep.torn += int(bool(res.get("torn")))
            if quiet:  # ending because the sender closed is expected; any other error is a false alarm
                error = res["error"] or ""
                ep.errors += int(bool(error) and "closed" not in error)
                continue
            if r != victim and res["t_error"] is not None:
                latency = res["t_error"] - t_fault
                ep.latencies.append(latency)
                if latency > LIVENESS_S + SLACK_S:
                    ep.unbounded.append(f"rank {r} raised {latency:.1f}s after the fault: {res['error']}")
            if r != victim and res["t_error"] is None:
                ep.unbounded.append(f"rank {r} never noticed the fault")
    finally:
        stop.set()
        members.reap()
    return ep


def schedule(network: bool) -> list[tuple[str, str, bool]]:
    """Episodes in turn: (fault, transport, on simulated hosts)."""
    local = [(f, t, False) for t in TRANSPORTS for f in FAULTS]
    net = [(f, t, True) for t in ("broadcast", "relay") for f in NET_FAULTS] if network else []
    return local + net


def run_chaos(
    seconds: float,
    *,
    receivers: int = 3,
    seed: int = 0,
    min_episodes: int = 1,
    progress: Callable[[Episode], None] | None = None,
    network: bool | None = None,
    only_network: bool = False,
) -> ChaosReport:
    """Run episodes for about ``seconds`` (at least ``min_episodes``); faults and transports in turn,
    moments at random (``seed``). ``network`` adds link cuts and packet loss on simulated hosts (default:
    when this process may make network namespaces); ``only_network`` runs those alone."""
    from .bench import netns

    if network is None:
        network = netns.unavailable_reason() is None
    if only_network and not network:
        raise RuntimeError(f"network faults need simulated hosts: {netns.unavailable_reason()}")
    plan = [e for e in schedule(network) if e[2] or not only_network]
    rng = random.Random(seed)
    report = ChaosReport()
    before = _shm_files()
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end or i < min_episodes:
        fault, transport, on_hosts = plan[i % len(plan)]
        if on_hosts:
            with netns.SimulatedHosts(receivers + 1, rate=None) as hosts:
                ep = run_episode(rng, receivers, transport, fault, hosts)
        else:
            ep = run_episode(rng, receivers, transport, fault)
        report.episodes.append(ep)
        if progress is not None:
            progress(ep)
        i += 1
    report.leaked_shm = _shm_files() - before
    return report
