"""An adapter-only update into a real vLLM beside a full update of the same model, interleaved in one run.

The model is the dense benchmark shape (bf16); the adapter is a PEFT LoRA of rank 16 on its attention and
MLP projections. ``adapter``: ``TrainerInitInfo(adapter="policy")``, the adapter's tensors through the bridge,
filed in each worker's memory under a fresh name, and one request served with it (vLLM loads an adapter on
its first use): the update's seconds, and the first request's. ``full``: the base model's weights through the
same bridge and vLLM's reload, as ``groupbridge bench --engine vllm``'s atomic row. One untimed update of each
comes first (first reload, first touch of the buffers).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from typing import Any

import torch

__all__ = ["run_adapter"]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_adapter(size: str = "bench", rounds: int = 3, rank: int = 16) -> list[dict[str, Any]]:
    """Seconds and bytes per update, adapter and full; ratios of adapter to full."""
    import transformers
    import vllm
    from peft import LoraConfig, get_peft_model
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from ..vllm import OfflineClient, TrainerInitInfo, adapter_request
    from ..vllm._stop import remove_new, segments, shutdown
    from ..vllm.models import make_model
    from .vllm_engine import _engine

    tmp = tempfile.TemporaryDirectory(prefix="gb-bench-adapter-")
    shm_before = segments()
    path = f"{tmp.name}/model"
    base = make_model(path, "qwen2", size, dtype="bfloat16")
    torch.manual_seed(0)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    peft = get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), config
    )
    llm = _engine(path, enable_lora=True, max_lora_rank=rank, max_loras=2, max_cpu_loras=2)
    sp = vllm.SamplingParams(max_tokens=1, temperature=0)
    times: dict[str, list[float]] = {}
    sent: dict[str, int] = {}
    first_request: list[float] = []
    try:
        for r in range(rounds + 1):
            for mode in ("adapter", "full"):
                with torch.no_grad():
                    for n, p in (peft if mode == "adapter" else base).named_parameters():
                        if mode == "full" or "lora_" in n:
                            p.add_(0.01)
                kw: dict[str, Any] = {"adapter": "policy"} if mode == "adapter" else {}
                info = TrainerInitInfo(rank=0, timeout_s=600, first_version=100 * (r + 1), **kw)
                source = ModuleSource(peft if mode == "adapter" else base)
                eng = WeightTransferTrainerFactory.trainer_init(
                    info, client=OfflineClient(llm), source=source
                )
                eng.send_weights()
                total = eng.last_seconds["total"]
                eng.shutdown()
                if mode == "adapter":
                    t0 = time.perf_counter()
                    llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False,
                                 lora_request=adapter_request(llm, "policy"))  # fmt: skip
                    if r > 0:
                        first_request.append(time.perf_counter() - t0)
                if r > 0:  # round 0 is the untimed warm-up
                    times.setdefault(mode, []).append(total)
                    assert eng.last_stats is not None
                    sent[mode] = eng.last_stats.bytes
    finally:
        shutdown(llm)
        del llm
        gc.collect()
        remove_new(shm_before)
        tmp.cleanup()
    full = statistics.median(times["full"])
    records = []
    for mode, ts in times.items():
        med = statistics.median(ts)
        records.append({
            "mode": mode, "bytes": sent[mode], "seconds": med, "min": min(ts), "max": max(ts),
            "bytes_vs_full": sent[mode] / sent["full"], "seconds_vs_full": med / full,
            "first_request": statistics.median(first_request) if mode == "adapter" else None,
        })  # fmt: skip
    return records
