"""``groupbridge demo``: a one-step-off-policy loop on this machine.

A trainer world (2 ranks, data-parallel SGD on a small transformer) and an inference world (2 workers, its
own global group) are bridged from trainer rank 0 to every worker. Each step the trainer trains and pushes
its weights as a new version; the workers receive atomically, check them bit for bit against a digest the
trainer sends, and generate a few tokens greedily with them while the trainer already computes the next
version. Trainer rank 0 owns the console.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._procs import publish_listener, run_roles
from .global_group import GlobalGroup, destroy_global_group, init_global_group
from .net import listen
from .stateless import StatelessGroup
from .weights import WeightReceiver, WeightSender

__all__ = ["DemoConfig", "TinyLM", "run_demo"]


@dataclass(kw_only=True)
class DemoConfig:
    steps: int = 30
    workers: int = 2
    transport: str = "auto"
    host: str = "::1"
    size: str = "demo"
    """demo (about 90 MB of fp32 weights) or tiny (for tests)."""
    json: bool = False
    trainers: int = 2
    delta: bool = False
    """Send only what changed (``WeightSender(delta="always")``: every step is diffed, so its changed
    fraction shows; where most of a bucket changed, the bucket still travels dense)."""


SIZES = {
    "demo": {"vocab": 64, "d": 512, "layers": 8, "heads": 8},
    "tiny": {"vocab": 64, "d": 32, "layers": 2, "heads": 2},
}


class TinyLM(nn.Module):
    """A small causal transformer written with plain torch."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: travels once, lands in both names
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n))
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        out: torch.Tensor = self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
        return out

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        out = list(prompt)
        for _ in range(new_tokens):
            logits = self(torch.tensor([out[-63:]]))
            out.append(int(logits[0, -1].argmax()))
        return out[len(prompt) :]


def digest(model: nn.Module) -> str:
    """A hash of every parameter's bytes, in state-dict order (what a worker checks bit-exactness with)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _batch(vocab: int, generator: torch.Generator, batch: int = 16, length: int = 24) -> torch.Tensor:
    """Counting sequences (t, t+1, t+2, ...) mod vocab: easy to learn, easy to eyeball in a greedy sample."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    return (start + torch.arange(length)) % vocab


def _make_model(cfg: DemoConfig) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(**SIZES[cfg.size])


def _join_world(rank: int, size: int, ports: Any, timeout: timedelta) -> GlobalGroup:
    """Start one of the demo's worlds: rank 0 binds the rendezvous socket and hands its port out."""
    world, port = publish_listener(rank, size, ports, "127.0.0.1")
    if world is not None:
        return init_global_group(rank=0, world_size=size, listener=world, timeout=timeout)
    return init_global_group(
        rank=rank, world_size=size, init_method=f"tcp://127.0.0.1:{port}", timeout=timeout
    )


def _trainer(rank: int, cfg: DemoConfig, q: dict[str, Any]) -> dict[str, Any]:
    """Ranks 0 .. trainers-1. Rank 0 also sends weights and owns the console."""
    timeout = timedelta(seconds=300)
    g = _join_world(rank, cfg.trainers, q["trainer"], timeout)
    model = _make_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + g.rank)
    vocab = SIZES[cfg.size]["vocab"]
    bridge = None
    rows: list[dict[str, Any]] = []
    if rank == 0:
        lis = listen(cfg.host, 0)
        for _ in range(cfg.workers):
            q["bridge"].put(str(lis.address))
        bridge = StatelessGroup.create(
            None, rank=0, world_size=cfg.workers + 1, listener=lis, timeout=timeout
        )
    console = _Console(cfg) if rank == 0 else None
    sender = (
        WeightSender(bridge, transport=cfg.transport, delta="always" if cfg.delta else False)
        if bridge is not None
        else None
    )
    samples: dict[int, Any] = {}
    for step in range(1, cfg.steps + 1):
        tokens = _batch(vocab, gen)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        for p in model.parameters():  # data parallel: average the gradients over the trainer world
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= g.world_size
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if bridge is None or sender is None or console is None:
            continue
        loss_value = avg.item() / g.world_size
        stats = sender.send(model, version=step, progress=console.progress(step))
        bridge.broadcast_obj({"version": step, "digest": digest(model)}, src=0)
        reports = [bridge.recv_obj(w, tag="verify") for w in range(1, cfg.workers + 1)]
        if step > 1:
            samples[step - 1] = [bridge.recv_obj(w, tag="sample") for w in range(1, cfg.workers + 1)]
        row = {
            "step": step, "version": step, "loss": round(loss_value, 4),
            "sync_seconds": round(stats.seconds, 4), "gb_per_s": round(stats.gb_per_s, 3),
            "bytes": stats.bytes, "transport": stats.transport,
            "verified": all(r["verified"] for r in reports),
            "delta": stats.delta, "changed_fraction": round(stats.changed_fraction, 5),
            "wire_bytes": stats.wire_bytes,
        }  # fmt: skip
        rows.append(row)
        console.row(row, samples.get(step - 1))
    if bridge is not None and console is not None:
        samples[cfg.steps] = [bridge.recv_obj(w, tag="sample") for w in range(1, cfg.workers + 1)]
        bridge.broadcast_obj({"version": None}, src=0)
        console.finish(rows, samples)
        bridge.close()
    destroy_global_group()
    return {"rows": rows, "samples": {str(k): v for k, v in samples.items()}}


def _worker(index: int, cfg: DemoConfig, q: dict[str, Any]) -> dict[str, Any]:
    """Inference workers: their own world (index 0 .. workers-1), bridge ranks 1 .. workers."""
    timeout = timedelta(seconds=300)
    _join_world(index, cfg.workers, q["worker"], timeout)
    address = q["bridge"].get(timeout=60)
    bridge = StatelessGroup.create(address, rank=index + 1, world_size=cfg.workers + 1, timeout=timeout)
    model = _make_model(cfg)
    model.eval()
    receiver = WeightReceiver(bridge, src=0)
    vocab = SIZES[cfg.size]["vocab"]
    failures = 0
    while True:
        version = receiver.receive_into(model, atomic=True)
        expected = bridge.broadcast_obj(None, src=0)
        ok = expected["version"] == version and expected["digest"] == digest(model)
        failures += not ok
        bridge.send_obj({"verified": ok, "version": version}, dst=0, tag="verify")
        prompt = [(7 * (index + 1)) % vocab, (7 * (index + 1) + 1) % vocab, (7 * (index + 1) + 2) % vocab]
        sample = model.generate(prompt, 5)  # with version v, while the trainer computes v + 1
        count = torch.tensor([float(len(sample))])
        dist.all_reduce(count)  # the inference world at work
        bridge.send_obj(
            {"worker": index, "version": version, "prompt": prompt, "tokens": sample}, dst=0, tag="sample"
        )
        if version == cfg.steps:
            break
    bridge.broadcast_obj(None, src=0)
    bridge.close()
    destroy_global_group()
    return {"failures": failures}


def _role(rank: int, cfg: DemoConfig, q: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    if rank < cfg.trainers:
        return _trainer(rank, cfg, q)
    return _worker(rank - cfg.trainers, cfg, q)


class _Console:
    """Progress bars and table rows on trainer rank 0 (rich when installed, plain lines otherwise)."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.t0 = time.monotonic()
        try:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self.console: Any = Console()
            self._progress_cls: Any = (Progress, BarColumn, DownloadColumn, TransferSpeedColumn)
        except ImportError:
            self.console = None
        if not cfg.json:
            self._print(
                f"trainer world: {cfg.trainers} ranks | inference world: {cfg.workers} workers | bridge on "
                f"{cfg.host} | {self.cfg.steps} steps, one step off-policy"
            )
            extra = f" {'changed':>8} {'wire MB':>8}" if cfg.delta else ""
            self._print(f"{'step':>4} {'version':>7} {'loss':>7} {'sync s':>7} {'GB/s':>6} {'transport':>9} "
                        f"{'verified':>8}{extra}  greedy (v-1)")  # fmt: skip

    def _print(self, text: str) -> None:
        if self.cfg.json:
            return
        if self.console is not None:
            self.console.print(text, highlight=False)
        else:
            print(text, flush=True)

    def progress(self, step: int) -> Any:
        if self.cfg.json or self.console is None:
            return None
        progress_cls, bar, download, speed = self._progress_cls
        bars = progress_cls(
            f"[cyan]sync v{step}", bar(), download(), speed(), console=self.console, transient=True
        )
        state: dict[str, Any] = {}

        def update(done: int, total: int) -> None:
            if "task" not in state:
                bars.start()
                state["task"] = bars.add_task("sync", total=total)
            bars.update(state["task"], completed=done)
            if done >= total:
                bars.stop()

        return update

    def row(self, row: dict[str, Any], sample: list[dict[str, Any]] | None) -> None:
        text = ""
        if sample:
            text = " ".join(map(str, sample[0]["prompt"])) + " -> " + " ".join(map(str, sample[0]["tokens"]))
        mark = "yes" if row["verified"] else "NO"
        extra = ""
        if self.cfg.delta:
            changed = f"{row['changed_fraction']:.2%}" if row["delta"] else "full"
            extra = f" {changed:>8} {row['wire_bytes'] / 1e6:>8.2f}"
        self._print(
            f"{row['step']:>4} {row['version']:>7} {row['loss']:>7.3f} {row['sync_seconds']:>7.3f} "
            f"{row['gb_per_s']:>6.2f} {row['transport']:>9} {mark:>8}{extra}  {text}"
        )

    def finish(self, rows: list[dict[str, Any]], samples: dict[int, Any]) -> None:
        last = samples.get(self.cfg.steps) or []
        ok = all(r["verified"] for r in rows)
        mean_gb_per_s = sum(r["gb_per_s"] for r in rows) / max(1, len(rows))
        wire = sum(r["wire_bytes"] for r in rows) / max(1, sum(r["bytes"] for r in rows))
        self._print(
            f"{len(rows)} syncs of {rows[-1]['bytes'] / 1e6:.1f} MB ({wire:.1%} of it on the wire), mean "
            f"{mean_gb_per_s:.2f} GB/s, "
            f"all verified: {'yes' if ok else 'NO'}; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; "
            f"last samples: {' '.join(str(s['tokens']) for s in last)}; {time.monotonic() - self.t0:.1f}s"
        )


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the demo; returns trainer rank 0's rows and whether every sync verified."""
    if not math.isfinite(cfg.steps) or cfg.steps < 1:
        raise ValueError(f"steps={cfg.steps} must be >= 1")
    ctx = mp.get_context("spawn")
    queues = {"trainer": ctx.Queue(), "worker": ctx.Queue(), "bridge": ctx.Queue()}
    results = run_roles(_role, cfg.trainers + cfg.workers, (cfg, queues), timeout=900,
                        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})  # fmt: skip
    rows = results[0]["rows"]
    failures = sum(r["failures"] for r in results[cfg.trainers :])
    return {
        "rows": rows,
        "samples": results[0]["samples"],
        "verified": failures == 0 and all(r["verified"] for r in rows),
    }
