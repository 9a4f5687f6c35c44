"""What packing a bucket of small pieces costs one thread: one ``torch._foreach_copy_`` of a view per piece
(the pack before runs) against one ``torch.cat`` per run of pieces end to end (``_bytes.Layout.runs``), both
from the same kept layout, alternated in one process; the bytes are checked equal. Usage::

    .venv/bin/python scripts/pack_runs_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = [(4, (2, 8)), (8, (2, 8)), (16, (2, 8)), (64, (2, 8)), (700, (2, 8))]
CASES += [(700, (1, 1024)), (64, (8, 512))]
"""(pieces, each piece's shape): rows of one tensor's box, as a source's pieces for one receiver are."""


def best_and_median(fn: Callable[[], None], reps: int = 200) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6, statistics.median(times) * 1e6


def main() -> None:
    import torch

    from groupbridge.weights import _bytes

    torch.set_num_threads(1)
    print("| pieces | shape | foreach, us (median) | runs, us (median) | runs / foreach |")
    print("|---|---|---|---|---|")
    for n, shape in CASES:
        g = torch.Generator().manual_seed(n)
        tensors = [torch.randn(4 * shape[0], *shape[1:], generator=g)[: shape[0]] for _ in range(n)]
        nbytes = tensors[0].numel() * 4
        bucket = torch.empty(n * nbytes, dtype=torch.uint8)
        parts = [(i * nbytes, nbytes, t, torch.float32) for i, t in enumerate(tensors)]
        runs = _bytes.layout(bucket, parts, runs=True)
        plain = runs._replace(runs=(), single=None)
        assert runs.runs, f"{n} pieces of {shape} make no run (fewer than {_bytes.MIN_RUN})"
        _bytes.copy_in(parts, plain)
        expected = bucket.clone()
        bucket.zero_()
        _bytes.copy_in(parts, runs)
        assert torch.equal(bucket, expected)
        a, am = best_and_median(partial(_bytes.copy_in, parts, plain))
        b, bm = best_and_median(partial(_bytes.copy_in, parts, runs))
        print(f"| {n} | {list(shape)} | {a:.0f} ({am:.0f}) | {b:.0f} ({bm:.0f}) | {bm / am:.2f} |")


if __name__ == "__main__":
    main()
