"""`make bench-check`: is HEAD slower than its base? Both revisions benchmarked interleaved, in one run.

Like ``asv continuous``: the base revision is checked out in a temporary git worktree, each side gets its own
three ranks (scripts/bench_check_worker.py, importing that side's groupbridge), and every round runs every
case on both sides back to back, the order alternating, so that a machine that drifts during the run
drifts for both. Ratios are taken per round and their median is reported beside the worst round of each
side. A row whose median ratio shows HEAD more than ``--threshold`` slower fails the check (exit status 1).

HEAD here is the working tree, uncommitted changes included (the table says so).

Usage: ``make bench-check [BASE=<rev>] [QUICK=1]``, or ``python scripts/bench_check.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "bench_check_worker.py"
CASES = ["broadcast-1", "broadcast-2", "shm-2", "relay-2", "delta-shm-2", "small-shm-2", "small-broadcast-2",
         "objects"]  # fmt: skip
WHAT = {
    "broadcast-1": "broadcast, 1 receiver, 64 MiB",
    "broadcast-2": "broadcast, 2 receivers, 64 MiB",
    "shm-2": "shm, 2 receivers, 96 MiB",
    "relay-2": "relay, 2 receivers, 64 MiB",
    "delta-shm-2": "delta (1/64 changed), shm, 2 receivers",
    "small-shm-2": "shm, 2 receivers, 256 KiB (the control plane)",
    "small-broadcast-2": "broadcast, 2 receivers, 256 KiB (control)",
    "objects": "broadcast_obj + all_gather_obj, 3 ranks",
}
REPLY_TIMEOUT_S = 120.0


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def default_base() -> str:
    """The commit HEAD's branch started from on main, or HEAD~1 when HEAD is on main."""
    head = git("rev-parse", "HEAD")
    try:
        fork = git("merge-base", "HEAD", "main")
    except subprocess.CalledProcessError:
        fork = head
    return git("rev-parse", "HEAD~1") if fork == head else fork


class Side:
    """One revision's worker: three ranks that run a case when told and report per-iteration times."""

    def __init__(self, label: str, tree: Path) -> None:
        self.label = label
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        hello = self._read()
        where = Path(hello["groupbridge"]).resolve()
        if not where.is_relative_to(tree.resolve()):
            raise SystemExit(f"{label}: the worker imported groupbridge from {where}, not from {tree}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise SystemExit(
                f"{self.label}: the worker did not answer within {REPLY_TIMEOUT_S:g}s "
                f"(exit status {self.proc.poll()}); see its output above"
            )
        return dict(json.loads(line))

    def run(self, case: str, iters: int) -> list[float] | str:
        """Per-iteration times, or why the case failed on this side (it is then dropped there)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"case": case, "iters": iters}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return str(reply["error"]) if "error" in reply else list(reply["times"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)


Results = dict[str, dict[str, list[float] | str]]


def measure(sides: list[Side], rounds: int, iters: int) -> Results:
    """{case: {label: [median time of each round] or the error that stopped it}}; round 0 warms every case
    up and is not kept."""
    out: Results = {c: {s.label: [] for s in sides} for c in CASES}
    for r in range(rounds + 1):
        for i, case in enumerate(CASES):
            order = sides if (r + i) % 2 == 0 else sides[::-1]
            for side in order:
                kept = out[case][side.label]
                if isinstance(kept, str):
                    continue  # failed on this side already
                times = side.run(case, iters)
                if isinstance(times, str):
                    out[case][side.label] = times
                    print(f"  {side.label} {case}: {times}", file=sys.stderr, flush=True)
                elif r > 0:
                    kept.append(statistics.median(times))
        if r > 0:
            print(f"  round {r}/{rounds} done", file=sys.stderr, flush=True)
    return out


def _cell(times: list[float] | str, unit: float) -> str:
    if isinstance(times, str):
        return "failed"
    return f"{statistics.median(times) * unit:.1f} / {max(times) * unit:.1f}"


def report(results: Results, head: str, base: str, threshold: float) -> bool:
    """Print the table; True when no row is more than ``threshold`` slower and HEAD failed nothing."""
    ok = True
    rows = []
    for case in CASES:
        h, b = results[case]["HEAD"], results[case]["BASE"]
        unit = 1e6 if case == "objects" else 1e3
        if isinstance(h, str):
            ok, ratio_text, verdict = False, "-", f"HEAD FAILED: {h}"
        elif isinstance(b, str):
            ratio_text, verdict = "-", f"base failed: {b}"
        else:
            ratio = statistics.median(x / y for x, y in zip(h, b, strict=True))
            slower = ratio > 1 + threshold
            ok &= not slower
            ratio_text = f"{ratio:.2f}x"
            verdict = "SLOWER" if slower else ("faster" if ratio < 1 - threshold else "same")
        rows.append((WHAT[case], _cell(b, unit), _cell(h, unit), ratio_text, verdict))
    header = ("case (time per sync in ms; objects: per op in us)", f"BASE {base} median / worst",
              f"HEAD {head} median / worst", "HEAD/BASE", "verdict")  # fmt: skip
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))
    print(
        f"HEAD/BASE: median over rounds of the per-round time ratio; a row fails above {1 + threshold:.2f}x"
    )
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="", help="base revision (default: where HEAD left main, or HEAD~1)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 2 iterations: about 45 s")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=0.15, help="fail when HEAD is this much slower")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    iters = 2 if args.quick else 3
    base = git("rev-parse", "--short", args.base or default_base())
    head = git("rev-parse", "--short", "HEAD") + (
        "+changes" if git("status", "--porcelain", "--", "groupbridge") else ""
    )
    tmp = Path(tempfile.mkdtemp(prefix="groupbridge-bench-base-"))
    t0 = time.monotonic()
    sides: list[Side] = []
    try:
        git("worktree", "add", "--detach", "--force", str(tmp / "tree"), base)
        print(f"bench-check: HEAD {head} against BASE {base}, {rounds} rounds", file=sys.stderr, flush=True)
        sides = [Side("HEAD", ROOT), Side("BASE", tmp / "tree")]
        results = measure(sides, rounds, iters)
    finally:
        for side in sides:
            side.close()
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(tmp / "tree")], cwd=ROOT, capture_output=True
        )
        shutil.rmtree(tmp, ignore_errors=True)
    ok = report(results, head, base, args.threshold)
    print(f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
