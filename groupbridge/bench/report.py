"""Tables and plots of benchmark records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _console

__all__ = ["local_sources_table", "plot", "sources_table", "table"]


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
        [
            "shape",
            "recv",
            "mode",
            "transport",
            "bucket",
            "bytes",
            "GB/s",
            "min-max",
            "vs flat",
            "vs per-tensor",
            "vs memcpy",
            "RSS MB snd/rcv",
        ],
        rows,
    )


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


def sources_table(records: Sequence[dict[str, Any]], rate: str) -> None:
    """``bench --sources``: many sources across simulated hosts against gathering, the link bound, deltas."""
    rows = [
        [
            r["sources"],
            f"{r['gather_then_send_s']:.2f} / {r['gather_then_send_worst_s']:.2f}",
            f"{r['many_sources_s']:.2f} / {r['many_sources_worst_s']:.2f}",
            f"{r['link_bound_s']:.2f}",
            f"{r['b_over_c']:.2f}x",
            f"{r['a_over_b']:.2f}x",
            f"{r['deltas_s']:.2f} / {r['deltas_worst_s']:.2f} ({r['deltas_changed_fraction']:.1%} changed)",
            f"{r['d_over_b']:.2f}x",
            f"{r['peak_rss_gib_rank0_b']:.2f} / {r['peak_rss_gib_rank0_all']:.2f}",
        ]
        for r in records
    ]
    gib = records[0]["model_bytes"] / 2**30 if records else 0
    _console.table(
        f"many sources: dense ({gib:.2f} GiB bf16), links at {rate}, s per sync (median / worst)",
        [
            "trainer hosts",
            "(a) gather + send",
            "(b) many sources",
            "(c) link bound",
            "b/c",
            "a/b",
            "(d) many sources, deltas",
            "d/b",
            "rank 0 peak RSS GiB (b / a+b+d)",
        ],
        rows,
    )


def replicas_table(records: Sequence[dict[str, Any]]) -> None:
    """``bench --replicas``: S trainer hosts into R whole replicas against the least any schedule could do."""
    modes = [m for m in ("forwarded", "direct", "gather") if records and f"{m}_s" in records[0]]
    rows = [
        [
            r["sources"],
            r["replicas"],
            f"{r['lower_bound_s']:.2f}",
            *(f"{r[f'{m}_s']:.2f} / {r[f'{m}_worst_s']:.2f} ({r[f'{m}_x_bound']:.2f}x)" for m in modes),
            "yes" if r["exact"] else "NO",
        ]
        for r in records
    ]
    what = {"forwarded": "receivers forward", "direct": "direct pairs", "gather": "gather, then send"}
    mib = records[0]["model_bytes"] >> 20 if records else 0
    _console.table(
        f"many trainer hosts into many replicas: {mib} MiB, each member its own host, links at "
        f"{records[0]['link_rate'] if records else ''}, s per sync (median / worst, x lower bound)",
        ["S trainers", "R replicas", "lower bound", *(what[m] for m in modes), "bit-exact"],
        rows,
    )


def local_sources_table(r: dict[str, Any]) -> None:
    """``bench --local-sources``: pairs over shm against p2p on one host, and a lazy source's memory."""
    rows = [
        [
            k,
            f"{r[f'{k}_s']:.2f} / {r[f'{k}_worst_s']:.2f}",
            f"{r[f'{k}_vs_memcpy']:.2f}x",
            f"{r['p2p_s'] / r[f'{k}_s']:.2f}x",
        ]
        for k in ("shm", "p2p")
    ]
    _console.table(
        f"many sources on one host: dense ({r['model_bytes'] / 2**30:.2f} GiB bf16), {r['sources']} sources, "
        f"{r['receivers']} receivers; memcpy of every receiver's bytes {r['memcpy_s']:.2f} s",
        ["pairs over", "s per sync (median / worst)", "vs memcpy", "vs p2p"],
        rows,
    )
    _console.echo(
        "[bench] a lazy source of shards over shm: the most memory a send added per source "
        + ", ".join(f"{x:.0f}" for x in r["lazy_extra_mib"])
        + f" MiB, against its shard {max(r['shard_mib']):.0f} MiB and a bucket {r['bucket_mib']:.0f} MiB"
    )


def scale_table(records: Sequence[dict[str, Any]]) -> None:
    """``bench --scale``: per row, the worst member's CPU and bytes on a first and a repeat sync."""
    rows = [
        [
            r["model"],
            str(r["tensors"]),
            f"{r['sources']} -> {r['receivers']}",
            f"{r['first']['cpu_s']:.3f} (rank {r['first']['worst_rank']})",
            f"{r['first']['source_cpu_s']:.3f}",
            f"{r['first']['fetched_bytes'] / 2**10:,.0f}",
            f"{r['repeat']['cpu_s'] * 1e3:.1f}",
            f"{r['repeat']['fetched_bytes'] / 2**10:,.1f}",
            f"{r['first']['pairs']}",
        ]
        for r in records
    ]
    _console.table(
        "the many-source handshake and plan, per member (the worst of the sample; CPU of this process)",
        [
            "model",
            "tensors",
            "trainer -> receiver ranks",
            "first: CPU s (worst)",
            "first: worst source",
            "first: KiB fetched",
            "repeat: CPU ms",
            "repeat: KiB fetched",
            "pairs",
        ],
        rows,
    )


def loopback_scale_table(r: dict[str, Any]) -> None:
    """``bench --loopback``: per sync, the slowest member's wall time, the most CPU one member spent, and
    what the store's own process spent (when it has one)."""
    per_sync = zip(
        r["wall_s"], r["cpu_s"], r["gc_s"], r["worst_cpu_rank"], r["cpu_s_not_rank0"], r["cpu_s_median"],
        r["store_cpu_s"], strict=True,
    )  # fmt: skip
    rows = [
        [str(k + 1), f"{w:.2f}", f"{c:.3f} (gc {g:.3f})", str(m), f"{o:.3f}", f"{med:.3f}", f"{st:.3f}"]
        for k, (w, c, g, m, o, med, st) in enumerate(per_sync)
    ]
    store = "the store in its own process" if r["store_host"] == "process" else "rank 0 serves the store"
    _console.table(
        f"loopback: {r['sources']} + {r['receivers']} processes, {r['tensors']} tensors, {store}; bit-exact: "
        f"{'yes' if r['exact'] else 'NO'}",
        ["sync", "slowest member, s", "most CPU one member spent, s", "that member", "most but rank 0, s",
         "median member, s", "store process, s"],
        rows,
    )  # fmt: skip
