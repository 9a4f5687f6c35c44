"""The serving stall: how long a client streaming from ``vllm serve`` gets no tokens during a weight update.

A client generates without pause from a real ``vllm serve`` (one streamed request after another) while the
trainer updates the weights, round by round, interleaved:

- ``groupbridge/atomic``: the bytes land on the worker's thread while vLLM serves, and are loaded into the
  worker's shadow copy of the model there; only the commit (``finish_weight_update``: the exchange of the
  two copies) stops it;
- ``groupbridge/atomic,swap=reload``: the same bytes, but the commit is vLLM's load of them into the
  serving model (no shadow): it stops serving for the load;
- ``groupbridge/streaming``: buckets go into vLLM's loader as they arrive: serving stops for the transfer;
- ``safetensors+reload``: ``save_pretrained`` then ``reload_weights`` (through the server's
  ``/collective_rpc``): serving stops for the reload;
- ``engine-free (same host)``, the anchor: the same atomic sync into a plain torch model in a process of
  its own, vLLM untouched: the stall the client sees from this host's cores being busy with the same bytes.

The stall of an update is the longest time without a token from its start to the first token after it,
less the client's usual time between tokens (the median of the 2 s before the update). The commit is
timed twice: by the trainer (the HTTP call, the wait for the model step under way, the engine's pause) and
by the engine core (its pause alone, between two model steps: ``_compat.PAUSED`` in the server's log).
"""

from __future__ import annotations

import itertools
import re
import statistics
import tempfile
import time
from typing import Any

import torch

__all__ = ["run_serving"]

ANCHOR = "engine-free (same host)"
MODES = (
    "groupbridge/atomic",
    "groupbridge/atomic,swap=reload",
    "groupbridge/streaming",
    "safetensors+reload",
    ANCHOR,
)


def _stall(times: list[float], start: float, end: float, deadline_s: float = 30.0) -> tuple[float, float]:
    """(stall, usual time between tokens) around an update in [start, end]: waits (bounded) for the first
    token after ``end``."""
    from ..vllm._serve import longest_gap

    limit = time.monotonic() + deadline_s
    while not any(t > end for t in times):
        if time.monotonic() > limit:
            raise TimeoutError(f"no token within {deadline_s:g} s of the update's end: serving stopped")
        time.sleep(0.01)
    after = min(t for t in times if t > end)
    before = [t for t in times if start - 2.0 < t < start]
    pace = statistics.median(b - a for a, b in itertools.pairwise(before)) if len(before) > 2 else 0.0
    return max(0.0, longest_gap(times, start, after) - pace), pace


def _paused(log: str, version: int) -> float | None:
    """The engine core's pause for the commit of ``version``, as its log states it (seconds)."""
    from ..vllm._compat import PAUSED

    found = re.findall(re.escape(f"{PAUSED} {version}:") + r" ([0-9.]+) ms", log)
    return float(found[-1]) / 1e3 if found else None


class _Rig:
    """What one serving run updates through: the trainer's model, the server and its client, the anchor's
    sender. Each mode is one method, timed alike by :func:`run_serving`."""

    def __init__(self, tmp: str, model: Any, srv: Any, snd: Any, *, tp: int, liveness: float) -> None:
        from ..vllm._control import HttpClient

        self.tmp, self.model, self.srv, self.snd, self.tp, self.liveness = tmp, model, srv, snd, tp, liveness
        self.client = HttpClient(srv.base, timeout=600)
        self.specs = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}

    def update(self, mode: str, r: int) -> tuple[float, float, float | None, float | None]:
        """One update in ``mode`` (round ``r``): (start, end, the trainer's commit, the engine's pause)."""
        if mode == "safetensors+reload":
            return self._reload()
        if mode == ANCHOR:
            return self._anchor(r)
        return self._groupbridge(mode, r)

    def _reload(self) -> tuple[float, float, None, None]:
        t0 = time.monotonic()
        self.model.save_pretrained(f"{self.tmp}/step")
        self.client.post("collective_rpc", {"method": "reload_weights",
                         "kwargs": {"weights_path": f"{self.tmp}/step"}})  # fmt: skip
        return t0, time.monotonic(), None, None

    def _anchor(self, r: int) -> tuple[float, float, None, None]:
        from datetime import timedelta

        t0 = time.monotonic()
        self.snd.send(dict(self.model.named_parameters()), version=r + 1, timeout=timedelta(seconds=300))
        return t0, time.monotonic(), None, None

    def _groupbridge(self, mode: str, r: int) -> tuple[float, float, float | None, float | None]:
        from ..engine import TrainerConfig, TrainerSession
        from ..vllm._control import VllmControl

        config = TrainerConfig(timeout_s=600, atomic="atomic" in mode, name="bench", workers=self.tp,
                               liveness_s=self.liveness, swap="reload" if "swap=reload" in mode else "shadow",
                               first_version=100 * (r + 1) + MODES.index(mode))  # fmt: skip
        with TrainerSession(config, VllmControl(self.client)) as session:
            session.connect()
            t0 = time.monotonic()
            session.send(dict(self.model.named_parameters()), specs=self.specs)
            t1 = time.monotonic()
            commit = session.last_seconds["commit"]
        version = session.version
        paused = _paused(self.srv.log.read_text(errors="replace"), version) if version else None
        return t0, t1, commit, paused


def run_serving(
    size: str = "bench",
    rounds: int = 3,
    dtype: str = "bfloat16",
    arch: str = "qwen2",
    *,
    tp: int = 1,
    modes: tuple[str, ...] = MODES,
) -> list[dict[str, Any]]:
    """Per mode (of :data:`MODES`): update seconds, the stall, and (groupbridge) the commit: the trainer's
    and the engine's. ``tp``: the server's tensor-parallel size (each worker takes its boxes of every
    tensor the trainer sends whole)."""
    import multiprocessing as mp

    import groupbridge as gb

    from .._procs import Roles, publish_listener
    from ..engine import TrainerConfig, TrainerSession
    from ..vllm._control import VllmControl
    from ..vllm._serve import Server, Streamer
    from ..vllm.models import make_model
    from .vllm_engine import _plain_receiver

    tmp = tempfile.TemporaryDirectory(prefix="gb-bench-serve-")
    model = make_model(f"{tmp.name}/model", arch, size, dtype=dtype)
    rows: dict[str, dict[str, list[float]]] = {
        m: {"seconds": [], "stall": [], "commit": [], "paused": []} for m in modes
    }
    srv = Server(f"{tmp.name}/model", log=f"{tmp.name}/serve.log", dtype=dtype, max_model_len=512, tp=tp,
                 start_s=300)  # fmt: skip
    shapes = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()}
    # two workers, each building and loading its shadow, on this host's cores beside the trainer and the
    # client: a process may not run for over 10 s (seen at tensor parallel 2 on 2 cores)
    liveness = 10.0 if tp == 1 else 60.0
    ports = mp.get_context("spawn").Queue()
    anchored = rounds if ANCHOR in modes else 0  # the receiver's count of the anchor's syncs
    anchor = Roles(_plain_receiver, 1, (ports, shapes, anchored), threads=1)
    try:
        lis, _ = publish_listener(0, 2, ports, "127.0.0.1")
        grp = gb.StatelessGroup.create(None, rank=0, world_size=2, listener=lis, name="anchor")
        snd = gb.WeightSender(grp, transport="auto", checksum=True)
        rig = _Rig(tmp.name, model, srv, snd, tp=tp, liveness=liveness)
        streamer = Streamer(srv, [11, 12, 13, 14], tokens=480)
        time.sleep(3.0)  # the client's pace settles
        with TrainerSession(
            TrainerConfig(timeout_s=600, liveness_s=liveness, name="bench", workers=tp),
            VllmControl(rig.client),
        ) as session:
            session.connect()  # untimed: the server's first reload and the first touch of its kept buffer
            session.send(dict(model.named_parameters()), specs=rig.specs)
        for r in range(rounds):
            for mode in modes:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                t0, t1, commit, paused = rig.update(mode, r)
                stall, _ = _stall(streamer.times, t0, t1)
                rows[mode]["seconds"].append(t1 - t0)
                rows[mode]["stall"].append(stall)
                if commit is not None:
                    rows[mode]["commit"].append(commit)
                if paused is not None:
                    rows[mode]["paused"].append(paused)
                time.sleep(1.0)
        streamer.stop()
        if streamer.errors:
            raise RuntimeError(f"the streaming client failed: {streamer.errors[0]}")
        snd.close()
        grp.barrier()
        grp.close()
        anchor.results(timeout=120)
    finally:
        anchor.reap()
        srv.close()
        tmp.cleanup()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return [
        {
            "mode": m, "arch": arch, "tp": tp, "bytes": nbytes, "dtype": dtype, "rounds": len(v["seconds"]),
            "seconds": statistics.median(v["seconds"]), "stall": statistics.median(v["stall"]),
            "stall_max": max(v["stall"]), "commit": statistics.median(v["commit"]) if v["commit"] else None,
            "paused": statistics.median(v["paused"]) if v["paused"] else None,
            "paused_max": max(v["paused"]) if v["paused"] else None,
            "stalls": v["stall"], "updates": v["seconds"], "commits": v["commit"], "pauses": v["paused"],
        }
        for m, v in rows.items()
    ]  # fmt: skip
