"""GPU check (under 5 minutes on one GPU): device detection, NCCL world of one, the checksum computed on the
device (GB/s beside a device copy, equal to its definition and to the CPU's), CUDA IPC weight sync, and the
many-source path on the GPU.

Two processes on one GPU: the sender holds a dense (Qwen2.5-0.5B-like, 0.92 GiB bf16) model on the GPU and
syncs it with ``transport="auto"`` (which must pick ``cuda_ipc``); the receiver checks every tensor bit for
bit, atomic and streaming, and the sender reports GB/s against a same-process device-to-device copy of the
same bytes. Then many sources: two trainer ranks holding row halves of 8 bf16 tensors (256 MiB) on the GPU
send to two tensor-parallel receivers taking column halves, atomic then streaming then a delta, over
``auto`` (CUDA IPC pairs on one host) and, with a GPU per member, over ``p2p`` (NCCL point to point; NCCL
refuses two ranks on one GPU, so one GPU skips it and says so). On a host without CUDA nothing runs and the
output says so. Run: ``python scripts/gpu_check.py [--json FILE]``.

Needs torch >= 2.8 and ``msgpack``. On a machine without internet that lacks msgpack, copy the package
folder from any Python's site-packages next to the checkout and put it on ``PYTHONPATH``: its pure-Python
fallback works without the compiled extension.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import groupbridge as gb
from groupbridge._procs import publish_listener, run_roles
from groupbridge.bench.models import bit_equal, dense_shapes, make_model

SYNCS = 4
SHARDED_SHAPE = (4096, 4096)
SHARDED_TENSORS = 8
SHARDED_MEMBERS = 4  # ranks 0, 1 send row halves; ranks 2, 3 take column halves


def _model(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.cuda() for k, v in make_model(dense_shapes(), seed=seed).items()}


def _role(rank: int, ports: Any) -> dict[str, Any]:
    torch.cuda.set_device(0)
    lis, port = publish_listener(rank, 2, ports, "127.0.0.1")
    g = gb.StatelessGroup.create(
        "127.0.0.1", port, rank=rank, world_size=2, listener=lis, timeout=timedelta(seconds=120)
    )
    if rank == 0:
        snd = gb.WeightSender(g, transport="auto")
        stats = []
        for v in range(1, SYNCS + 1):
            model = _model(seed=v)
            torch.cuda.synchronize()
            stats.append(snd.send(model, version=v))
        src = torch.empty(stats[0].bytes, dtype=torch.uint8, device="cuda").fill_(1)
        dst = torch.empty_like(src)
        copies = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            copies.append(stats[0].bytes / (time.perf_counter() - t0) / 1e9)
        snd.close()
        g.close()
        return {
            "transport": stats[0].transport,
            "bytes": stats[0].bytes,
            "sync_gb_per_s": [round(s.gb_per_s, 2) for s in stats],
            "device_copy_gbps": round(statistics.median(copies), 1),
        }
    rcv = gb.WeightReceiver(g, src=0, device="cuda")
    target = _model(seed=0)
    checks = []
    for v in range(1, SYNCS + 1):
        atomic = v % 2 == 1
        if v == SYNCS:
            got = {n: t.clone() for n, t in rcv.receive()}
        else:
            rcv.receive_into(target, atomic=atomic)
            got = target
        want = _model(seed=v)
        checks.append(all(bit_equal(got[k], want[k]) for k in want))
    g.close()
    return {"bit_exact": checks, "version": rcv.version}


def _sharded_full(name: int, version: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * version + name)
    return torch.randn(SHARDED_SHAPE, generator=g, dtype=torch.float32).to(torch.bfloat16).to(device)


def _sharded_role(rank: int, ports: Any, transport: str, kind: str) -> dict[str, Any]:
    device = torch.device(kind, rank % torch.cuda.device_count()) if kind == "cuda" else torch.device(kind)
    if kind == "cuda":
        torch.cuda.set_device(device)
    lis, port = publish_listener(rank, SHARDED_MEMBERS, ports, "127.0.0.1")
    g = gb.StatelessGroup.create("127.0.0.1", port, rank=rank, world_size=SHARDED_MEMBERS, listener=lis,
                                 timeout=timedelta(seconds=120))  # fmt: skip
    rows, cols = SHARDED_SHAPE
    versions = [(1, "atomic"), (2, "streaming"), (3, "delta")]
    if rank < 2:
        snd = gb.WeightSender(g, transport=transport, delta="always")
        stats = []
        for v, _ in versions:
            start, end = rank * rows // 2, (rank + 1) * rows // 2
            mine = [_sharded_full(i, v, device)[start:end].clone() for i in range(SHARDED_TENSORS)]
            held = {f"w{i}": gb.Shard(t, SHARDED_SHAPE, (start, 0)) for i, t in enumerate(mine)}
            if kind == "cuda":
                torch.cuda.synchronize()
            stats.append(snd.send(held, version=v))
        snd.close()
        g.close()
        return {
            f"source{rank}": {
                "transports": sorted({s.transport for s in stats}),
                "bytes": stats[0].bytes,
                "gb_per_s": [round(s.gb_per_s, 2) for s in stats],
                "delta": [s.delta for s in stats],
            }
        }
    rcv = gb.WeightReceiver(g, device=device)
    half = cols // 2
    offset = (rank - 2) * half
    zeros = [torch.zeros(rows, half, dtype=torch.bfloat16, device=device) for _ in range(SHARDED_TENSORS)]
    target = {f"w{i}": gb.Shard(z, SHARDED_SHAPE, (0, offset)) for i, z in enumerate(zeros)}
    exact = []
    for v, mode in versions:
        rcv.receive_into(target, atomic=mode != "streaming")
        want = [_sharded_full(i, v, device)[:, offset : offset + half] for i in range(SHARDED_TENSORS)]
        exact.append(all(torch.equal(target[f"w{i}"].tensor, w) for i, w in enumerate(want)))
    g.close()
    return {f"receiver{rank}": {"bit_exact": exact, "version": rcv.version}}


def _sharded(transport: str, kind: str = "cuda") -> dict[str, Any]:
    if kind == "cuda" and transport == "p2p" and torch.cuda.device_count() < SHARDED_MEMBERS:
        return {"ran": False, "why": f"NCCL needs a GPU per member ({SHARDED_MEMBERS}); this host has "
                f"{torch.cuda.device_count()}"}  # fmt: skip
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    for part in run_roles(_sharded_role, SHARDED_MEMBERS, (mp.get_context("spawn").Queue(), transport, kind),
                          timeout=240):  # fmt: skip
        out.update(part)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["ok"] = all(all(v["bit_exact"]) for k, v in out.items() if k.startswith("receiver"))
    return out


def _device_digest() -> dict[str, Any]:
    """The checksum computed on the device (``checksum=True`` for device tensors): GB/s on 256 MiB beside a
    device-to-device copy of it, and the same value as its plain-Python definition on a small buffer and as
    the same function on the CPU for the same bytes."""
    from groupbridge.weights._device_digest import checksum64, reference_checksum64

    buf = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)

    def rate(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return round(buf.numel() / best / 1e9, 1)

    small = buf[: (1 << 16) + 5]
    return {
        "digest_gbps": rate(lambda: checksum64(buf)),
        "device_copy_gbps": rate(lambda: dst.copy_(buf)),
        "same_as_definition": checksum64(small) == reference_checksum64(bytes(small.cpu().numpy())),
        "same_as_cpu": checksum64(buf[: 32 << 20]) == checksum64(buf[: 32 << 20].cpu()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--cpu-sharded",
        action="store_true",
        help="run only the many-source part, on the CPU (checks this script, not a GPU)",
    )
    args = parser.parse_args()
    if args.cpu_sharded:
        print(json.dumps({f"sharded_{t}": _sharded(t, "cpu") for t in ("auto", "p2p")}, indent=1))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"ran": False, "why": "this host has no CUDA device: nothing was checked"}))
        return 0
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "accelerator": gb.accelerator(),
        "split_backend": gb.split_backend(),
    }
    try:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        g = gb.init_global_group()
        t = torch.ones(4, device=g.device)
        torch.distributed.all_reduce(t)
        out["global_group"] = {"backend": g.backend, "device": g.device, "all_reduce": t.tolist()}
        gb.destroy_global_group()
    except Exception as e:  # report and go on: the other checks are independent
        out["global_group"] = f"FAILED {type(e).__name__}: {e}"
    try:
        lis = gb.listen("127.0.0.1", 0)
        g1 = gb.StatelessGroup.create(None, rank=0, world_size=1, listener=lis, timeout=timedelta(seconds=60))
        x = torch.arange(8.0, device="cuda")
        g1.broadcast(x, src=0)
        g1.all_reduce(x)
        out["stateless_nccl"] = x.tolist()
        g1.close()
    except Exception as e:
        out["stateless_nccl"] = f"FAILED {type(e).__name__}: {e}"
    try:
        out["device_digest"] = _device_digest()
    except Exception as e:
        out["device_digest"] = f"FAILED {type(e).__name__}: {e}"
    t0 = time.perf_counter()
    try:
        sender, receiver = run_roles(_role, 2, (mp.get_context("spawn").Queue(),), timeout=240)
        out["cuda_ipc"] = {**sender, **receiver, "seconds": round(time.perf_counter() - t0, 1)}
        out["cuda_ipc"]["ratio_vs_device_copy"] = round(
            statistics.median(sender["sync_gb_per_s"]) / sender["device_copy_gbps"], 3
        )
    except Exception as e:
        out["cuda_ipc"] = f"FAILED {type(e).__name__}: {e}"
    for transport in ("auto", "p2p"):
        try:
            out[f"sharded_{transport}"] = _sharded(transport)
        except Exception as e:
            out[f"sharded_{transport}"] = f"FAILED {type(e).__name__}: {e}"
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    ok = isinstance(out["cuda_ipc"], dict) and all(out["cuda_ipc"]["bit_exact"])
    digest = out["device_digest"]
    ok = ok and isinstance(digest, dict) and digest["same_as_definition"] and digest["same_as_cpu"]
    for transport in ("auto", "p2p"):
        part = out[f"sharded_{transport}"]
        ok = ok and isinstance(part, dict) and (part.get("ran") is False or part["ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
