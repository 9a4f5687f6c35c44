"""Tables and plots of benchmark records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _console

__all__ = ["plot", "table"]


def _ratio(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(records: Sequence[dict[str, Any]]) -> None:
    rows = []
    for r in records:
        rows.append([
            r["shape"], r["receivers"], r["mode"], r["transport"],
            "-" if r.get("bucket_bytes") is None else f"{r['bucket_bytes'] >> 20} MiB",
            f"{r['bytes'] / 2**30:.2f} GiB", f"{r['gbps']:.2f}", f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f}",
            _ratio(r.get("ratio_vs_flat")),
            _ratio(r.get("ratio_vs_per_tensor")),
            _ratio(r.get("ratio_vs_memcpy")),
            f"{r['rss_sender_mb']}/{r['rss_receiver_mb']}",
        ])  # fmt: skip
    _console.table(
        "weight sync (GB/s per receiver, median of rounds; ratios: median of per-round ratios)",
        ["shape", "recv", "mode", "transport", "bucket", "bytes", "GB/s", "min-max", "vs flat",
         "vs per-tensor", "vs memcpy", "RSS MB snd/rcv"],
        rows,
    )  # fmt: skip


def plot(records: Sequence[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'groupbridge[plot]'") from e
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ours = [r for r in records if r["mode"].startswith("ours")]
    for mode in sorted({r["mode"] for r in ours}):
        for n in sorted({r["receivers"] for r in ours}):
            pts = sorted(
                (r["bucket_bytes"], r["gbps"]) for r in ours if r["mode"] == mode and r["receivers"] == n
            )
            if pts:
                a.plot(
                    [p[0] / 2**20 for p in pts], [p[1] for p in pts], marker="o", label=f"{mode}, {n} recv"
                )
    a.set_xscale("log", base=2)
    a.set_xlabel("bucket size (MiB)")
    a.set_ylabel("GB/s per receiver")
    a.set_title("bandwidth against bucket size")
    a.legend(fontsize=7)
    from ..weights.sender import DEFAULT_BUCKET_BYTES

    for mode in sorted({r["mode"] for r in records} - {"memcpy"}):
        chosen = [
            r for r in records if r["mode"] == mode and r.get("bucket_bytes") in (None, DEFAULT_BUCKET_BYTES)
        ]
        pts = sorted({r["receivers"]: r["gbps"] for r in chosen}.items())
        b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    b.set_xlabel("receivers")
    b.set_ylabel("GB/s per receiver")
    b.set_title("bandwidth against receivers (default bucket size)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
