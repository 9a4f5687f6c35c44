"""What the shadow costs a vLLM worker in host memory, against ``swap="reload"``: what docs/memory.md reports.

For each swap mode, a fresh offline vLLM engine (CPU build) serves a locally built Qwen2 of the ``bench``
shape (Qwen2.5-0.5B's: 290 tensors), and a trainer sends it ``--updates`` updates. The engine's processes
(everything below this one: the engine core and its worker) are measured by their resident memory (RSS, and
USS: the pages no other process shares) after the engine started, and after each update. The growth is what
the mode costs on top of the serving model, given as a multiple of the checkpoint's bytes.
Usage::

    .venv/bin/python scripts/shadow_memory.py            # bfloat16
    .venv/bin/python scripts/shadow_memory.py --dtype float32
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _engine_mib() -> tuple[float, float]:
    """(RSS, USS) of every process below this one, in MiB."""
    import psutil

    rss = uss = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, uss = rss + info.rss / 2**20, uss + info.uss / 2**20
    return rss, uss


def _run(swap: str, dtype: str, updates: int) -> dict[str, Any]:
    import torch
    import vllm
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from groupbridge.vllm import OfflineClient, TrainerInitInfo
    from groupbridge.vllm._stop import shutdown
    from groupbridge.vllm.models import make_model

    with tempfile.TemporaryDirectory() as d:
        model = make_model(d, "qwen2", "bench", dtype=dtype)
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
        nbytes = sum(seen.values())  # a tied embedding once
        llm = vllm.LLM(
            d,
            dtype=dtype,
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=4,
            kv_cache_memory_bytes=1 << 28,
            weight_transfer_config={"backend": "groupbridge"},
        )
        try:
            marks = {"started": _engine_mib()}
            info = TrainerInitInfo(rank=0, timeout_s=600, liveness_s=30, swap=swap)
            eng = WeightTransferTrainerFactory.trainer_init(
                info, client=OfflineClient(llm), source=ModuleSource(model)
            )
            try:
                for step in range(1, updates + 1):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(0.01 * step)
                    eng.send_weights(version=step)
                    marks[f"update {step}"] = _engine_mib()
            finally:
                eng.shutdown()
        finally:
            shutdown(llm)
            del llm
            gc.collect()
    return {"bytes": nbytes, "marks": marks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--updates", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for swap in ("reload", "shadow"):
        got = _run(swap, args.dtype, args.updates)
        mib = got["bytes"] / 2**20
        start_rss, start_uss = got["marks"]["started"]
        for mark, (rss, uss) in got["marks"].items():
            rows.append((swap, mark, rss, uss, (rss - start_rss) / mib, (uss - start_uss) / mib, mib))
    print(f"{'swap':<8} {'after':<10} {'RSS MiB':>9} {'USS MiB':>9} {'RSS growth':>11} {'USS growth':>11}")
    for swap, mark, rss, uss, grow_rss, grow_uss, _ in rows:
        print(f"{swap:<8} {mark:<10} {rss:9.0f} {uss:9.0f} {grow_rss:10.2f}x {grow_uss:10.2f}x")
    print(f"(growth: since the engine started, in multiples of the checkpoint's {rows[0][6]:.0f} MiB)")


if __name__ == "__main__":
    main()
