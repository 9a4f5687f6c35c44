"""``groupbridge bench``: its options and how each measurement is run and shown (the CLI's other commands
live in :mod:`groupbridge.cli`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from .. import _console

__all__ = ["add_bench_parser"]


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


_MEASUREMENTS = (
    "delta",
    "simulate_hosts",
    "sources",
    "replicas",
    "local_sources",
    "control",
    "engine",
    "scale",
    "loopback",
)
_SHAPED = ("shape", "receivers", "bucket_bytes", "modes", "transport", "shrink", "link_rate", "payload_bytes")
"""Settings of one measurement that ``--plot``'s own set does not take."""


def _cmd_bench(args: argparse.Namespace) -> int:
    from .report import table
    from .weight_sync import BenchConfig, run_weight_sync

    if args.plot:
        defaults = _defaults()
        chosen = [f"--{m.replace('_', '-')}" for m in _MEASUREMENTS if getattr(args, m)]
        chosen += [f"--{m.replace('_', '-')}" for m in _SHAPED if getattr(args, m) != getattr(defaults, m)]
        if chosen:
            raise SystemExit(
                f"--plot DIR measures and draws its own set of figures; run it without {', '.join(chosen)}"
            )
        if args.plot.endswith(".png"):
            raise SystemExit(
                f"--plot takes a directory (it writes its figures and bench.json), not {args.plot}"
            )
        from .plots import FIGURES, run_all

        only = args.figures.split(",") if args.figures else None
        unknown = sorted(set(only or ()) - set(FIGURES))
        if unknown:
            raise SystemExit(f"no figure named {', '.join(unknown)}: the figures are {', '.join(FIGURES)}")
        done = run_all(args.plot, quick=args.quick, rounds=2 if args.quick else args.rounds, only=only)
        if args.json:
            print(json.dumps(done, indent=1))
        return 0
    if args.delta:
        return _bench_delta(args)
    if args.simulate_hosts:
        return _bench_hosts(args)
    if args.replicas:
        return _bench_replicas(args)
    if args.sources:
        return _bench_sources(args)
    if args.local_sources:
        return _bench_local_sources(args)
    if args.control:
        return _bench_control(args)
    if args.scale or args.loopback:
        return _bench_scale(args)
    if args.engine == "vllm" and args.adapter:
        return _bench_adapter(args)
    if args.engine == "vllm":
        return _bench_vllm(args)
    shape = "tiny" if args.quick else args.shape
    rounds = 2 if args.quick else args.rounds
    receivers = [int(r) for r in args.receivers.split(",")]
    buckets = [_parse_bytes(b) for b in args.bucket_bytes.split(",")]
    modes = args.modes.split(",")
    records: list[dict[str, object]] = []
    for n in receivers:
        cfg = BenchConfig(
            shape=shape,
            receivers=n,
            bucket_bytes=buckets,
            rounds=rounds,
            modes=modes,
            host=args.host,
            transport=args.transport or "broadcast",
            threads=None if args.threads == "default" else int(args.threads),
        )
        if not args.json:
            _console.echo(
                f"[bench] {shape}, {n} receiver(s), {rounds} interleaved rounds of {', '.join(modes)} ..."
            )
        records += run_weight_sync(cfg)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        table(records)
    return 0


def _shown(args: argparse.Namespace, intro: str, run: Callable[[], Any], show: Callable[[Any], None]) -> int:
    """A measurement: what it is (unless ``--json``), then its records, as JSON or as ``show`` draws them."""
    if not args.json:
        _console.echo(intro)
    records = run()
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        show(records)
    return 0


def _bench_vllm(args: argparse.Namespace) -> int:
    from .vllm_engine import run_vllm
    from .vllm_serving import run_serving

    size = "tiny" if args.quick else "bench"
    if not args.json:
        _console.echo(
            f"[bench] one update into vLLM ({size} Qwen2, bf16), {args.rounds} interleaved rounds: "
            "groupbridge (auto, broadcast; atomic, streaming; verified; a fleet of two), safetensors + "
            "reload_weights, the same sync into a plain torch model; then the serving stall of a client "
            f"streaming from vllm serve{' (float32)' if args.quick else ''}: dense, MoE, dense at TP 2 ..."
        )
    records = run_vllm(size=size, rounds=args.rounds)
    # the tiny model is served in float32: see bench.plots._measure_stall
    dtype = "float32" if args.quick else "bfloat16"
    serving = [
        row for arch in ("qwen2", "qwen3_moe") for row in run_serving(size, args.rounds, dtype, arch=arch)
    ]
    # tensor parallel 2: each worker takes its boxes
    serving += run_serving(
        size, args.rounds, dtype, tp=2, modes=("groupbridge/atomic", "groupbridge/streaming")
    )
    if args.json:
        print(json.dumps({"update": records, "serving": serving}, indent=1))
        return 0
    _console.table(
        "one weight update into vLLM (seconds, median of rounds)",
        ["mode", "bytes", "seconds", "min-max", "faster than reload", "vs engine-free", "vLLM load", "probe"],
        [
            [
                r["mode"],
                f"{r['bytes'] / 2**30:.2f} GiB",
                f"{r['seconds']:.2f}",
                f"{r['min']:.2f}-{r['max']:.2f}",
                f"{r['vs_reload']:.2f}x",
                f"{r['vs_engine_free']:.2f}x",
                "-" if r["load"] is None else f"{r['load']:.2f}",
                "-" if r.get("probe") is None else f"{r['probe']:.2f}",
            ]
            for r in records
        ],
    )
    _console.table(
        "serving during an update: a client streaming from vllm serve (seconds, median of rounds)",
        ["model", "mode", "update", "stall", "worst stall", "commit (trainer)", "engine pause (worst)"],
        [
            [
                f"{r['arch']}, TP {r['tp']}" if r["tp"] > 1 else r["arch"],
                r["mode"],
                f"{r['seconds']:.2f}",
                f"{r['stall']:.2f}",
                f"{r['stall_max']:.2f}",
                "-" if r["commit"] is None else f"{r['commit']:.3f}",
                "-" if r["paused"] is None else f"{r['paused'] * 1e3:.1f} ms ({r['paused_max'] * 1e3:.1f})",
            ]
            for r in serving
        ],
    )
    return 0


def _bench_adapter(args: argparse.Namespace) -> int:
    from .vllm_adapter import run_adapter

    size = "tiny" if args.quick else "bench"
    intro = (f"[bench] a rank-16 LoRA adapter update into vLLM against a full update ({size} Qwen2, bf16), "
             f"{args.rounds} interleaved rounds ...")  # fmt: skip
    return _shown(args, intro, lambda: run_adapter(size=size, rounds=args.rounds), lambda rs: _console.table(
        "adapter-only update into vLLM against a full update (seconds, median of rounds)",
        ["mode", "bytes", "seconds", "min-max", "bytes vs full", "seconds vs full", "first request"],
        [
            [r["mode"], f"{r['bytes'] / 2**20:.1f} MiB", f"{r['seconds']:.3f}",
             f"{r['min']:.3f}-{r['max']:.3f}", f"{r['bytes_vs_full']:.3f}x", f"{r['seconds_vs_full']:.3f}x",
             "-" if r["first_request"] is None else f"{r['first_request']:.3f}"]
            for r in rs
        ],
    ))  # fmt: skip


def _bench_control(args: argparse.Namespace) -> int:
    from .control import run_control

    intro = "[bench] broadcast_obj of a small dict, rank 0 -> 2 receivers, interleaved rounds ..."
    return _shown(args, intro, lambda: run_control(rounds=args.rounds + 2), lambda records: _console.table(
        "control plane, microseconds per receive: back to back (median of rounds, worst round) and one at a "
        "time (median delay, longest one); ratio per round to the peer's",
        ["mode", "measure", "us per receive", "range over receivers", "worst us", "vs peer", "keys freed"],
        [
            [r["mode"], r["measure"], r["us_per_receive"], r["us_range"], r["worst_us"],
             f"{r['vs_peer']:.2f}x", r["keys_freed"]]
            for r in records
        ],
    ))  # fmt: skip


def _bench_delta(args: argparse.Namespace) -> int:
    from .delta import MODES, DeltaConfig, run_delta

    shape = "tiny" if args.quick else args.shape
    rounds = 2 if args.quick else args.rounds
    if args.simulate_hosts:
        # every host lives on this one machine: receivers stream into their targets (no kept copy) and
        # delta_always is left out, or the model's copies would not fit in memory
        runs = [dict(transport="relay", receivers=args.simulate_hosts - 1, hosts_rate=args.link_rate,
                     modes=("full", "delta"), atomic=False)]  # fmt: skip
    else:
        transports = ["broadcast", "shm"] if args.transport is None else [args.transport]
        runs = [dict(transport=t, receivers=1, hosts_rate=None, modes=MODES, atomic=True) for t in transports]
    records: list[dict[str, Any]] = []
    for run in runs:
        cfg = DeltaConfig(shape=shape, rounds=rounds, **run)
        if args.quick:
            cfg.lrs = [1e-6]
        if not args.json:
            hosts = f"{run['receivers'] + 1} simulated hosts at {run['hosts_rate']}"
            where = hosts if run["hosts_rate"] else "loopback"
            _console.echo(
                f"[bench] delta sync, {shape} fp32 master weights sent as bf16, one Adam step per sync at "
                f"lr {', '.join(f'{x:g}' for x in cfg.lrs)}; {cfg.transport} over {where}, {rounds} steps "
                "each ..."
            )
        records += run_delta(cfg)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    rows = []
    for r in records:
        rows.append([
            r["transport"], r["link"], f"{r['lr']:g}", r["mode"],
            "-" if r["changed_fraction"] is None else f"{r['changed_fraction']:.2%}",
            f"{r['wire_fraction']:.1%}",
            f"{r['deltas']}/{r['steps']}", f"{r['seconds']:.2f}",
            "-" if r["ratio_vs_full"] is None else f"{r['ratio_vs_full']:.2f}x",
        ])  # fmt: skip
    _console.table(
        f"delta sync, {shape}: {records[0]['bytes'] / 2**30:.2f} GiB as bf16 (medians of the steps; ratio: "
        "median of per-step ratios)",
        ["transport", "link", "lr", "mode", "changed", "wire/bytes", "as delta", "seconds", "vs full"],
        rows,
    )
    return 0


def _bench_hosts(args: argparse.Namespace) -> int:
    from .hosts import HostsConfig, run_hosts

    cfg = HostsConfig(receivers=sorted({1, args.simulate_hosts - 1}), rate=args.link_rate,
                      payload_bytes=_parse_bytes(args.payload_bytes), rounds=args.rounds,
                      transports=("broadcast", "relay"))  # fmt: skip
    intro = f"[bench] {args.simulate_hosts} simulated hosts at {cfg.rate}, {cfg.payload_bytes >> 20} MiB ..."
    return _shown(args, intro, lambda: run_hosts(cfg), lambda records: _console.table(
        f"simulated hosts, links at {cfg.rate} (time per sync, median)",
        ["transport", "receivers", "seconds", "link limit s", "vs link limit", "vs 1 receiver"],
        [
            [r["transport"], r["receivers"], f"{r['seconds']:.2f}", f"{r['link_limit_s']:.2f}",
             f"{r['ratio_vs_link']:.2f}x", f"{r['ratio_vs_one_receiver']:.2f}x"]
            for r in records
        ],
    ))  # fmt: skip


def _replica_cases(sources: str, replicas: str) -> list[tuple[int, int]]:
    """``--replicas``: "SxR" pairs as they are; a plain R with every S of ``--sources``."""
    cases = []
    for item in replicas.split(","):
        if "x" in item:
            s, r = item.split("x")
            cases.append((int(s), int(r)))
        else:
            if not sources:
                raise SystemExit(f"--replicas {item} needs --sources S,... (or write it SxR)")
            cases += [(int(s), int(item)) for s in sources.split(",")]
    return cases


def _bench_replicas(args: argparse.Namespace) -> int:
    from . import report
    from .replicas import ReplicasConfig, run_replicas

    rate = args.link_rate if args.link_rate != "800mbit" else "200mbit"
    cfg = ReplicasConfig(cases=_replica_cases(args.sources, args.replicas), rate=rate, rounds=args.rounds)
    cases = ", ".join(f"{s}x{r}" for s, r in cfg.cases)
    intro = (f"[bench] many trainer hosts into many replicas (S x R: {cases}), each member its own host "
             f"at {cfg.rate}, {cfg.model_bytes >> 20} MiB; {cfg.rounds} interleaved rounds of forwarding, "
             "direct pairs and gather-then-send ...")  # fmt: skip
    return _shown(args, intro, lambda: run_replicas(cfg), report.replicas_table)


def _bench_sources(args: argparse.Namespace) -> int:
    from . import report
    from .sources import SourcesConfig, run_sources

    cfg = SourcesConfig(
        sources=[int(t) for t in args.sources.split(",")],
        rate=args.link_rate,
        rounds=args.rounds,
        scale=args.shrink,
    )
    intro = f"[bench] many sources: {cfg.sources} trainer hosts + 4 inference hosts at {cfg.rate} ..."
    return _shown(
        args, intro, lambda: run_sources(cfg), lambda records: report.sources_table(records, cfg.rate)
    )


def _bench_local_sources(args: argparse.Namespace) -> int:
    from . import report
    from .sources_local import LocalSourcesConfig, run_local_sources

    cfg = LocalSourcesConfig(
        sources=args.local_sources,
        receivers=int(args.receivers.split(",")[0]),
        rounds=args.rounds,
        scale=args.shrink,
    )
    intro = (f"[bench] many sources on one host: {cfg.sources} sources -> {cfg.receivers} receivers (whole "
             "tensors, atomic), shm against p2p, interleaved ...")  # fmt: skip
    return _shown(args, intro, lambda: run_local_sources(cfg), report.local_sources_table)


def _loopback(args: argparse.Namespace, cfg: Any) -> None:
    from . import report
    from .scale_loopback import run_loopback_scale

    intro = (
        f"[bench] loopback, real processes: {cfg.sources} sources with FSDP row slices of {cfg.tensors} "
        f"tensors into {cfg.receivers} receivers taking TP-{cfg.tp} row blocks over p2p, {cfg.syncs} "
        "syncs ..."
    )
    _shown(args, intro, lambda: run_loopback_scale(cfg), report.loopback_scale_table)


def _bench_scale(args: argparse.Namespace) -> int:
    from . import report
    from .scale import run_scale_rows
    from .scale_loopback import LoopbackScaleConfig

    if args.scale:
        intro = (
            "[bench] the many-source handshake and plan at the size of real jobs: real models' tensors "
            "(meta device), FSDP x EP trainers into replicas of TP 8; each member's CPU and bytes, "
            "the worst of a sample of every kind of member ..."
        )
        echo = None if args.json else _console.echo
        _shown(args, intro, lambda: run_scale_rows(quick=args.quick, progress=echo), report.scale_table)
    for case in (args.loopback or "").split(","):
        if case:
            s, r = (int(v) for v in case.lower().split("x"))
            _loopback(args, LoopbackScaleConfig(sources=s, receivers=r))
    return 0


def add_bench_parser(sub: Any) -> None:
    """The ``bench`` subcommand and its options, on the CLI's subparsers."""
    p = sub.add_parser("bench", help="weight-sync speed beside its anchors (flat tensor, per-tensor, memcpy)")
    p.add_argument("--shape", default="dense", choices=["dense", "moe", "moe-half", "tiny"])
    p.add_argument("--receivers", default="1", help="comma-separated receiver counts, e.g. 1,2")
    p.add_argument(
        "--bucket-bytes", default="64MiB", help="comma-separated sizes: a sweep, e.g. 4MiB,16MiB,64MiB"
    )
    p.add_argument(
        "--modes",
        default="ours,ours_flat,flat,per_tensor",
        help="ours, ours_flat (both sides flatten_), ours_shared (shm: the sender's flattened model in "
        "shared memory, read in place), ours_atomic, ours_sealed (ours_atomic in a group with a token), "
        "flat, per_tensor",
    )
    p.add_argument(
        "--transport",
        default=None,
        choices=["broadcast", "relay", "shm", "auto"],
        help="default: broadcast (with --delta: broadcast and shm, one after the other)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", default="1", help="torch intra-op threads during a sync, or 'default'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--quick", action="store_true", help="a small model, two rounds: under a minute")
    p.add_argument("--json", action="store_true", help="print one JSON record per measurement")
    p.add_argument(
        "--simulate-hosts",
        type=int,
        default=0,
        metavar="N",
        help="N hosts in network namespaces (root): relay against broadcast, 1 and N-1 receivers",
    )
    p.add_argument(
        "--sources",
        default="",
        metavar="T,...",
        help="many sources on simulated hosts (root): T trainer hosts with FSDP shards of the dense shape, "
        "4 inference hosts (2 replicas x TP 2); gather-then-send against every trainer sending",
    )
    p.add_argument(
        "--replicas",
        default="",
        metavar="R|SxR,...",
        help="many trainer hosts into many replicas on simulated hosts (root): S sources (each R with every "
        "S of --sources, or SxR) holding row shards of a 64 MiB model, R receivers taking it whole; "
        "forwarding against direct pairs and gather-then-send, beside the lower bound (links at 200mbit "
        "unless --link-rate says)",
    )
    p.add_argument(
        "--local-sources",
        type=int,
        default=0,
        metavar="T",
        help="many sources on one host: T sources with FSDP shards of the dense shape to --receivers "
        "receivers, shm against p2p",
    )
    p.add_argument(
        "--shrink",
        type=int,
        default=1,
        help="with --sources/--local-sources: divide the dense shape's widths",
    )
    p.add_argument(
        "--scale",
        action="store_true",
        help="the many-source handshake and plan per member at real jobs' sizes (Llama-3-70B, Qwen3-235B, "
        "DeepSeek-V3, Kimi-K2's shape; 64-512 trainer ranks into 16 replicas of TP 8), simulated one member "
        "at a time; --quick: two models, two sizes",
    )
    p.add_argument(
        "--loopback",
        default="",
        help="comma-separated SxR, e.g. 8x8,48x16: the same handshake with S + R real processes on loopback "
        "(700 small tensors, three syncs), each member's CPU per sync",
    )
    p.add_argument("--link-rate", default="800mbit", help="link rate of simulated hosts (tc syntax)")
    p.add_argument("--payload-bytes", default="128MiB", help="payload for --simulate-hosts")
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="measure and draw the figures of docs/results.md into DIR (throughput against its ceilings, "
        "delta cost against the share changed, many sources against trainer hosts, the serving stall of vllm "
        "serve), with their records in DIR/bench.json; --quick: small shapes (needs groupbridge[plot])",
    )
    p.add_argument(
        "--figures",
        metavar="NAME,...",
        help="with --plot: measure and draw only these (throughput, delta, sources, replicas, stall, scale), "
        "keeping the others' records in DIR/bench.json",
    )
    p.add_argument(
        "--control", action="store_true", help="control-plane latency (broadcast_obj) beside vLLM's protocol"
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="delta sync beside a full one: fp32 master weights, one Adam step per sync, sent as bf16 "
        "(loopback broadcast and shm; with --simulate-hosts N: relay over N hosts)",
    )
    p.add_argument(
        "--engine",
        choices=["vllm"],
        help="one update into a real vLLM (the CPU build here) beside its anchors",
    )
    p.add_argument(
        "--adapter",
        action="store_true",
        help="with --engine vllm: a rank-16 LoRA adapter update against a full update of the same model",
    )
    p.set_defaults(func=_cmd_bench)


def _defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="groupbridge")
    add_bench_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["bench"])
