"""``groupbridge``: doctor | demo | bench."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

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
    for key in ("ipv4_loopback", "ipv6_loopback"):
        lo = facts[key]
        detail = f"listen={yes[lo['listen']]} store={yes[bool(lo.get('store'))]}"
        if lo.get("error"):
            detail += f" ({lo['error']})"
        rows.append([f"{key.replace('_', ' ')} {lo['host']}", detail])
    _console.table("groupbridge doctor", ["check", "result"], rows)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    _cmd_doctor(argparse.Namespace(json=False))
    _console.echo("\nA 2-rank world under torchrun, no backend named anywhere:")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        "-m",
        "groupbridge._hello_world",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env, timeout=300, check=False).returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="groupbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="what this machine offers: backends, accelerator, loopback, store")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_doctor)
    p = sub.add_parser("demo", help="see it work on this machine")
    p.add_argument("--nproc", type=int, default=2)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
