"""``groupbridge bench --plot DIR``: the figures of docs/results.md, each drawn from one measurement.

``groupbridge bench --plot DIR --figures delta`` measures one again, keeping the others' records.

A plot is only as honest as the run behind it, so every figure is drawn from records measured in the same
command (the anchors beside what they anchor), and the records are written next to the images
(``bench.json``) so a reader can check a bar against its number. Each bar or point is a median of rounds;
the worst round is drawn beside it where the records hold it (an error bar to the worst: throughput,
sources, stall), since an intermittent stall hides in a median.

- ``throughput.png``: GB/s per receiver of each mode (``ours``, ``ours_flat``, per-tensor broadcast) for 1
  and 2 receivers, under the flat-tensor broadcast and memcpy ceilings of the same run; ``buckets.png``, from
  the same records: GB/s against the bucket size.
- ``delta.png``: a delta sync's time and wire bytes as fractions of a full sync's, against the fraction of
  the model that changed (one Adam step at several learning rates), over loopback: ``delta="always"`` (every
  step diffed) and ``delta=True`` (a delta only where it pays).
- ``sources.png``: seconds per sync against the number of trainer hosts: gather to rank 0 then send, every
  trainer sending its shards, the same with deltas, and the link bound (simulated hosts: root).
- ``stall.png``: how long a client streaming from ``vllm serve`` gets no token during an update, per update
  mode (vLLM's CPU build).
- ``scale.png`` and ``scale_bytes.png``: the many-source handshake's CPU seconds and bytes fetched per
  member against the trainer ranks, first sync and repeat, for real models' tensor inventories
  (``bench --scale``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .. import _console

__all__ = ["FIGURES", "delta", "replicas", "run_all", "scale", "sources", "stall", "throughput"]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'groupbridge[plot]'") from e
    return plt


@contextlib.contextmanager
def _figure(path: str | Path) -> Iterator[Any]:
    """One figure's axes for the block; drawn to ``path`` (with its legend) when the block ends normally, and
    closed either way (pyplot keeps every open figure)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        yield ax
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def throughput(records: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Bars per mode and receiver count, the flat-tensor and memcpy ceilings as lines over them."""
    from ..weights.sender import DEFAULT_BUCKET_BYTES

    def chosen(r: dict[str, Any]) -> bool:
        return r.get("bucket_bytes") in (None, DEFAULT_BUCKET_BYTES)

    bars = [m for m in ("ours", "ours_flat", "ours_shared", "ours_atomic", "per_tensor")
            if any(r["mode"] == m for r in records)]  # fmt: skip
    receivers = sorted({r["receivers"] for r in records})
    width = 0.8 / max(len(bars), 1)
    with _figure(path) as ax:
        for i, mode in enumerate(bars):
            rs = {r["receivers"]: r for r in records if r["mode"] == mode and chosen(r)}
            xs = [k + (i - (len(bars) - 1) / 2) * width for k in range(len(receivers)) if receivers[k] in rs]
            ys = [rs[n]["gbps"] for n in receivers if n in rs]
            worst = [rs[n]["gbps"] - rs[n]["gbps_min"] for n in receivers if n in rs]
            ax.bar(xs, ys, width, yerr=[worst, [0] * len(worst)], capsize=3, label=f"{mode} (median, worst)")
        for anchor, style in (("flat", "--"), ("memcpy", ":")):
            for k, n in enumerate(receivers):
                found = [r for r in records if r["mode"] == anchor and r["receivers"] == n]
                if found:
                    ax.hlines(found[0]["gbps"], k - 0.45, k + 0.45, colors="k", linestyles=style,
                              label=f"{anchor} ceiling" if k == 0 else None)  # fmt: skip
        ax.set_xticks(range(len(receivers)), [f"{n} receiver(s)" for n in receivers])
        ax.set_ylabel("GB/s per receiver")
        if records:
            r0 = records[0]
            ax.set_title(f"full sync, {r0['shape']} ({r0['bytes'] / 2**30:.2f} GiB), loopback")


def delta(records: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Time and wire bytes of a delta sync relative to a full one, against the fraction that changed."""
    with _figure(path) as ax:
        for transport in sorted({r["transport"] for r in records}):
            rs = sorted((r for r in records if r["transport"] == transport and r["mode"] == "delta_always"
                         and r["changed_fraction"] is not None),
                        key=lambda r: r["changed_fraction"])  # fmt: skip
            if not rs:
                continue
            xs = [100 * r["changed_fraction"] for r in rs]
            ax.plot(
                xs,
                [r["ratio_vs_full"] for r in rs],
                marker="o",
                label=f'delta="always": time vs full ({transport})',
            )
            ax.plot(xs, [r["wire_fraction"] for r in rs], marker="x", linestyle="--",
                    label=f'delta="always": bytes on the wire vs full ({transport})')  # fmt: skip
            # delta=True sends what pays: the same steps (every mode sends the same weights), by share changed
            chosen = {r["lr"]: r for r in records if r["transport"] == transport and r["mode"] == "delta"}
            pts = [
                (100 * r["changed_fraction"], chosen[r["lr"]]["ratio_vs_full"])
                for r in rs
                if r["lr"] in chosen
            ]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s",
                        label=f"delta=True: time vs full ({transport})")  # fmt: skip
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xscale("log")
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("share of the model that changed in one Adam step (%)")
        ax.set_ylabel("delta sync / full sync")
        ax.set_title(f"delta sync, {records[0]['shape']} sent as bf16" if records else "delta sync")


def _medians(ax: Any, xs: list[int], rs: list[dict[str, Any]], series: Sequence[tuple[str, str]]) -> None:
    """One line per (record key, label): the median seconds, the error bar up to the worst round."""
    for key, label in series:
        med = [r[f"{key}_s"] for r in rs]
        worst = [r[f"{key}_worst_s"] - r[f"{key}_s"] for r in rs]
        ax.errorbar(
            xs, med, yerr=[[0] * len(med), worst], marker="o", capsize=3, label=f"{label} (median, worst)"
        )


def sources(records: Sequence[dict[str, Any]], path: str | Path, rate: str = "") -> None:
    """Seconds per sync against trainer hosts: gathering, every trainer sending, deltas, the link bound."""
    with _figure(path) as ax:
        rs = sorted(records, key=lambda r: r["sources"])
        xs = [r["sources"] for r in rs]
        _medians(ax, xs, rs, (("gather_then_send", "(a) gather to rank 0, then send"),
                              ("many_sources", "(b) every trainer sends its shards"),
                              ("deltas", "(d) (b) with deltas")))  # fmt: skip
        ax.plot(xs, [r["link_bound_s"] for r in rs], "k:", label="(c) link bound")
        ax.set_xticks(xs)
        ax.set_xlabel("trainer hosts")
        ax.set_ylabel("seconds per sync")
        gib = rs[0]["model_bytes"] / 2**30 if rs else 0
        ax.set_title(f"many sources: {gib:.2f} GiB to 4 inference hosts, links at {rate}")
        ax.set_ylim(bottom=0)


def replicas(records: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Seconds per sync against replicas for four trainer hosts: forwarding, direct pairs, gathering, the
    lower bound."""
    with _figure(path) as ax:
        rs = sorted((r for r in records if r["sources"] == 4), key=lambda r: r["replicas"])
        xs = [r["replicas"] for r in rs]
        _medians(ax, xs, rs, (("forwarded", "receivers forward"),
                              ("direct", "every receiver from the sources"),
                              ("gather", "gather to rank 0, then send")))  # fmt: skip
        ax.plot(xs, [r["lower_bound_s"] for r in rs], "k:", label="lower bound")
        ax.set_xticks(xs)
        ax.set_xlabel("replicas (each its own host)")
        ax.set_ylabel("seconds per sync")
        mib = rs[0]["model_bytes"] >> 20 if rs else 0
        ax.set_title(
            f"4 trainer hosts into R replicas: {mib} MiB, links at {rs[0]['link_rate'] if rs else ''}"
        )
        ax.set_ylim(bottom=0)


def stall(records: Sequence[dict[str, Any]], path: str | Path) -> None:
    """The longest gap without a token a streaming client saw during an update, per update mode."""
    with _figure(path) as ax:
        modes = [r["mode"] for r in records]
        med = [r["stall"] for r in records]
        worst = [r["stall_max"] - r["stall"] for r in records]
        ax.bar(
            range(len(modes)),
            med,
            0.5,
            yerr=[[0] * len(med), worst],
            capsize=4,
            label="stall (median, worst)",
        )
        ax.plot(range(len(modes)), [r["seconds"] for r in records], "kx", label="update time (median)")
        ax.set_xticks(range(len(modes)), modes)
        ax.set_ylabel("seconds")
        ax.set_title("vllm serve during one update: time a streaming client got no token")


def scale(records: Sequence[dict[str, Any]], path: str | Path, what: str = "cpu_s") -> None:
    """Per member, against the trainer ranks (log-log): the worst member's CPU seconds (``what="cpu_s"``)
    or KiB fetched (``"fetched_bytes"``), first sync and repeat, one line per model; a line of slope one
    (linear growth) beside them from the first point."""
    scale_of = 1.0 if what == "cpu_s" else 1 / 2**10
    with _figure(path) as ax:
        for model in sorted({r["model"] for r in records}):
            rs = sorted((r for r in records if r["model"] == model), key=lambda r: r["sources"])
            xs = [r["sources"] for r in rs]
            for sync, style in (("first", "-"), ("repeat", "--")):
                ax.plot(
                    xs,
                    [r[sync][what] * scale_of for r in rs],
                    marker="o",
                    linestyle=style,
                    label=f"{model}: {sync} sync",
                )
        if records:
            r0 = min(records, key=lambda r: r["sources"])
            x0, y0 = r0["sources"], r0["first"][what] * scale_of
            top = max(r["sources"] for r in records)
            ax.plot(
                [x0, top], [y0, y0 * top / x0], color="k", linewidth=0.8, linestyle=":", label="linear in S"
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("trainer ranks S (into replicas of TP 8)")
        ax.set_ylabel("CPU s per member" if what == "cpu_s" else "KiB fetched per member")
        ax.set_title("the many-source handshake and plan, the worst member's share")


def _measure_scale(quick: bool, rounds: int) -> list[dict[str, Any]]:
    from .scale import run_scale_rows

    return run_scale_rows(quick=quick, progress=_console.echo)


def _draw_scale(records: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    scale(records, out / "scale.png")
    scale(records, out / "scale_bytes.png", what="fetched_bytes")
    return [out / "scale.png", out / "scale_bytes.png"]


def _measure_throughput(quick: bool, rounds: int) -> list[dict[str, Any]]:
    from .weight_sync import BenchConfig, run_weight_sync

    records: list[dict[str, Any]] = []
    for n in (1, 2):
        cfg = BenchConfig(shape="tiny" if quick else "dense", receivers=n, rounds=rounds,
                          bucket_bytes=[16 << 20, 64 << 20, 256 << 20],
                          modes=["ours", "ours_flat", "flat", "per_tensor"])  # fmt: skip
        records += run_weight_sync(cfg)
    return records


def _draw_throughput(records: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    from .report import plot

    plot(records, str(out / "buckets.png"))
    throughput(records, out / "throughput.png")
    return [out / "throughput.png", out / "buckets.png"]


def _draw(
    fn: Callable[..., None], name: str, **kw: Any
) -> Callable[[Sequence[dict[str, Any]], Path], list[Path]]:
    def draw(records: Sequence[dict[str, Any]], out: Path) -> list[Path]:
        fn(records, out / f"{name}.png", **kw)
        return [out / f"{name}.png"]

    return draw


def _measure_delta(quick: bool, rounds: int) -> list[dict[str, Any]]:
    from .delta import DeltaConfig, run_delta

    lrs = [1e-6, 1e-4] if quick else [1e-8, 1e-7, 1e-6, 1e-5, 1e-4]
    cfg = DeltaConfig(shape="tiny" if quick else "dense", rounds=rounds, lrs=lrs,
                      modes=("full", "delta", "delta_always"))  # fmt: skip
    return run_delta(cfg)


def _measure_sources(quick: bool, rounds: int) -> list[dict[str, Any]]:
    from .sources import SourcesConfig, run_sources

    cfg = SourcesConfig(sources=[1, 2] if quick else [1, 2, 4], rounds=rounds, scale=8 if quick else 2)
    return run_sources(cfg)


def _measure_replicas(quick: bool, rounds: int) -> list[dict[str, Any]]:
    from .replicas import ReplicasConfig, run_replicas

    cases = [(4, r) for r in ((1, 4) if quick else (1, 2, 4, 8))]
    return run_replicas(ReplicasConfig(cases=cases, rounds=rounds, model_bytes=(16 if quick else 64) << 20))


def _measure_stall(quick: bool, rounds: int) -> list[dict[str, Any]]:
    from .vllm_serving import run_serving

    # --quick serves the tiny model in float32: vLLM's CPU build died of SIGILL decoding it in bfloat16
    # under `vllm serve` on a CPU with AMX (a 2-core Xeon, 2026-12-04; the bench size in bfloat16 served)
    return run_serving(
        size="tiny" if quick else "bench", rounds=rounds, dtype="float32" if quick else "bfloat16"
    )


def _sources_reason() -> str | None:
    from . import netns

    return netns.unavailable_reason()


def _stall_reason() -> str | None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed"
    return None


_Measure = Callable[[bool, int], list[dict[str, Any]]]
_Draw = Callable[[Sequence[dict[str, Any]], Path], list[Path]]
FIGURES: dict[str, tuple[_Measure, _Draw, str]] = {
    "throughput": (_measure_throughput, _draw_throughput,
                   "full sync against its ceilings, 1 and 2 receivers, three bucket sizes"),
    "delta": (_measure_delta, _draw(delta, "delta"), "delta sync against the share that changed"),
    "sources": (_measure_sources, _draw(sources, "sources", rate="800mbit"),
                "many sources against the number of trainer hosts"),
    "replicas": (_measure_replicas, _draw(replicas, "replicas"),
                 "four trainer hosts into 1-8 replicas, each its own host"),
    "stall": (_measure_stall, _draw(stall, "stall"), "serving stall of vllm serve per update mode"),
    "scale": (_measure_scale, _draw_scale,
              "the many-source handshake per member against the trainer ranks, real models' tensors"),
}  # fmt: skip
"""name -> (measure(quick, rounds), draw(records, into), what it shows)."""


def run_all(
    out: str | Path, *, quick: bool = False, rounds: int = 3, only: Sequence[str] | None = None
) -> dict[str, Any]:
    """Measure and draw every figure (or those in ``only``) into ``out``; return the records by figure
    (also in bench.json, where a figure not measured now keeps the records of the run that drew it).

    A figure whose measurement cannot run here (no network namespaces, no vLLM) is left out with the reason
    printed and recorded; the others are still drawn.
    """
    unknown = sorted(set(only or ()) - set(FIGURES))
    if unknown:
        raise ValueError(f"no figure named {', '.join(unknown)}: the figures are {', '.join(FIGURES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    skip = {"sources": _sources_reason(), "replicas": _sources_reason(), "stall": _stall_reason()}
    done: dict[str, Any] = {"quick": quick, "rounds": rounds, "figures": {}, "left_out": {}}
    if only and (out / "bench.json").exists():
        done = json.loads((out / "bench.json").read_text())
        if (done.get("quick"), done.get("rounds")) != (quick, rounds):
            raise ValueError(
                f"{out / 'bench.json'} was measured with quick={done.get('quick')}, "
                f"rounds={done.get('rounds')}: "
                "measure every figure again, or pass the same --quick and --rounds"
            )
    for name, (measure, draw, what) in FIGURES.items():
        if only and name not in only:
            continue
        done["left_out"].pop(name, None)
        if skip.get(name):
            done["left_out"][name] = skip[name]
            _console.echo(f"[bench] {name}.png left out: {skip[name]}")
            continue
        _console.echo(f"[bench] {name}: {what} ...")
        records = measure(quick, rounds)
        done["figures"][name] = records
        (out / "bench.json").write_text(json.dumps(done, indent=1))
        for path in draw(records, out):
            _console.echo(f"[bench] wrote {path}")
    (out / "bench.json").write_text(json.dumps(done, indent=1))
    return done
