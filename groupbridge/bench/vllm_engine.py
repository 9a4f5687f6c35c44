"""One weight update into a real vLLM engine, beside the two anchors that say what it is worth.

Modes, interleaved round by round in one run (the machine's noise hits them alike):

- ``groupbridge/<transport>``: backend ``"groupbridge"`` into an offline ``vllm.LLM``, atomic (landed in the
  worker's kept buffer, then loaded in ``finish_weight_update``): wall time of ``send_weights()``, and of
  its commit, vLLM's own ``load_weights`` of the staged tensors from memory (with the RPC to it);
- ``groupbridge/<transport>/streaming``: buckets go into vLLM's loader as they arrive;
- ``safetensors+reload``: what a CPU user does without us: the trainer writes safetensors
  (``save_pretrained``) and vLLM reloads them (``collective_rpc("reload_weights", weights_path=...)``).
- ``engine-free``: the same groupbridge sync (auto transport, atomic, XXH3 checksum) into a plain torch model
  in another process: the ceiling for the engine path.
- ``groupbridge/auto/verified``: atomic, with ``verify=Probe(...)``: the worker copies the version it serves
  aside before the update lands (the rollback copy) and, after the swap, vLLM scores a 32-token probe that
  the trainer compares with its own model; the probe's own seconds in their column.
- ``groupbridge/auto/fleet-2`` (``fleet``): a second engine with the same model; both updated as one fleet
  (one bridge, one commit): the replicas land in parallel, so it should cost about one replica's update.

Each round opens a new trainer session per mode (they cannot share one engine's bridge at once); the worker
keeps its receive buffers across sessions. One untimed update comes first: the engine's first reload and the
first touch of the worker's kept buffer cost 3-5 s once, and would land on whichever mode goes first.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

from .._procs import Roles, publish_listener

__all__ = ["run_vllm"]


def _plain_receiver(
    rank: int, ports: Any, shapes: dict[str, tuple[tuple[int, ...], str]], rounds: int
) -> float:
    """The engine-free anchor's receiver: a plain torch model, ``rounds`` atomic updates."""
    import groupbridge as gb

    del rank
    port = ports.get(timeout=120)
    target = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in shapes.items()}
    with gb.StatelessGroup.create("127.0.0.1", port, rank=1, world_size=2, name="anchor") as grp:
        rcv = gb.WeightReceiver(grp, src=0)
        for _ in range(rounds):
            rcv.receive_into(target, atomic=True, timeout=timedelta(seconds=300))
        rcv.close()
        grp.barrier()
    return float(sum(t.float().sum().item() for t in target.values()))


def _engine(path: str, **extra: Any) -> Any:
    """An offline engine of the bench's settings, backend "groupbridge" (``extra``: more of vLLM's)."""
    import vllm

    return vllm.LLM(
        path,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.3,  # on CPU: the share of host memory vLLM takes (the trainer is here too)
        weight_transfer_config={"backend": "groupbridge"},
        **extra,
    )


def run_vllm(
    size: str = "bench",
    rounds: int = 3,
    transports: tuple[str, ...] = ("auto", "broadcast"),
    fleet: bool = True,
) -> list[dict[str, Any]]:
    """Time one update per mode per round; records carry seconds, ratios and vLLM's load share."""
    import multiprocessing as mp

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    import groupbridge as gb

    from ..engine import Probe, causal_logprobs
    from ..vllm import FleetClient, OfflineClient, TrainerInitInfo
    from ..vllm._stop import remove_new, segments, shutdown
    from ..vllm.models import make_model

    tmp = tempfile.TemporaryDirectory(prefix="gb-bench-vllm-")
    shm_before = segments()
    model = make_model(f"{tmp.name}/model", "qwen2", size, dtype="bfloat16")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    llm = _engine(f"{tmp.name}/model")
    second = _engine(f"{tmp.name}/model") if fleet else None
    tokens = [(i * 7919) % 500 + 1 for i in range(32)]
    # bf16 on both sides, other kernels: within a few hundredths; a wrong layer moves them by units
    probe = Probe(tokens, lambda v: causal_logprobs(model, tokens), atol=0.5)
    probe_s: list[float] = []
    shapes = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()}
    ports = mp.get_context("spawn").Queue()
    anchor = Roles(_plain_receiver, 1, (ports, shapes, rounds), threads=1)
    times: dict[str, list[float]] = {}
    load_share: dict[str, list[float]] = {}
    try:
        lis, _ = publish_listener(0, 2, ports, "127.0.0.1")
        grp = gb.StatelessGroup.create(None, rank=0, world_size=2, listener=lis, name="anchor")
        snd = gb.WeightSender(grp, transport="auto", checksum=True)  # as TrainerInitInfo(checksum=True)
        # untimed: the engine's first reload and the first touch of the worker's kept buffer (3-5 s once)
        warm = TrainerInitInfo(rank=0, timeout_s=600, first_version=1)
        client, source = OfflineClient(llm), ModuleSource(model)
        eng = WeightTransferTrainerFactory.trainer_init(warm, client=client, source=source)
        eng.send_weights()
        eng.shutdown()
        if second is not None:
            eng = WeightTransferTrainerFactory.trainer_init(warm, client=OfflineClient(second), source=source)
            eng.send_weights()
            eng.shutdown()
        for r in range(rounds):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            for transport in transports:
                for atomic in (True, False):
                    info = TrainerInitInfo(rank=0, transport=transport, timeout_s=600, atomic=atomic,
                                           first_version=100 * (r + 1))  # fmt: skip
                    eng = WeightTransferTrainerFactory.trainer_init(
                        info, client=OfflineClient(llm), source=ModuleSource(model)
                    )
                    eng.send_weights()
                    mode = f"groupbridge/{transport}" + ("" if atomic else "/streaming")
                    times.setdefault(mode, []).append(eng.last_seconds["total"])
                    if atomic:  # the commit is vLLM's load of the staged update (with its RPC)
                        load_share.setdefault(mode, []).append(eng.last_seconds["commit"])
                    eng.shutdown()
            extra: list[tuple[str, Any, dict[str, Any]]] = [
                ("groupbridge/auto/verified", OfflineClient(llm), {"verify": probe})
            ]
            if second is not None:
                both = FleetClient([OfflineClient(llm), OfflineClient(second)])
                extra.append(("groupbridge/auto/fleet-2", both, {"workers": 2}))
            for mode, client, kw in extra:
                info = TrainerInitInfo(rank=0, timeout_s=600, first_version=100 * (r + 1) + 50, **kw)
                eng = WeightTransferTrainerFactory.trainer_init(
                    info, client=client, source=ModuleSource(model)
                )
                # verified: the first update of a session has no rollback copy to take; the second is timed
                if "verify" in kw:
                    eng.send_weights()
                eng.send_weights()
                times.setdefault(mode, []).append(eng.last_seconds["total"])
                load_share.setdefault(mode, []).append(eng.last_seconds["commit"])
                if "verify" in kw:
                    probe_s.append(eng.last_seconds["verify"])
                eng.shutdown()
            t0 = time.perf_counter()
            model.save_pretrained(f"{tmp.name}/step")
            llm.collective_rpc("reload_weights", kwargs={"weights_path": f"{tmp.name}/step"})
            times.setdefault("safetensors+reload", []).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            snd.send(dict(model.named_parameters()), version=r + 1, timeout=timedelta(seconds=300))
            times.setdefault("engine-free", []).append(time.perf_counter() - t0)
        snd.close()
        grp.barrier()
        grp.close()
        anchor.results(timeout=120)
    finally:
        anchor.reap()
        shutdown(llm)
        if second is not None:
            shutdown(second)
        del llm, second
        gc.collect()
        remove_new(shm_before)  # what the engine left in /dev/shm (vLLM 0.32 leaves some)
        tmp.cleanup()
    ceiling = statistics.median(times["engine-free"])
    baseline = statistics.median(times["safetensors+reload"])
    records = []
    for mode, ts in times.items():
        med = statistics.median(ts)
        records.append({
            "mode": mode, "bytes": nbytes, "seconds": med, "min": min(ts), "max": max(ts), "rounds": len(ts),
            "vs_reload": baseline / med, "vs_engine_free": med / ceiling,
            "load": statistics.median(load_share[mode]) if mode in load_share else None,
            "probe": statistics.median(probe_s) if mode.endswith("/verified") else None,
        })  # fmt: skip
    return records
