"""A plain vLLM engine (no weight-transfer backend) started in this process, for
``tests/test_vllm.py::test_a_plain_engine_beside_groupbridge_is_vllms_own``: prints, as JSON, its greedy
tokens and what vLLM's classes hold, in this process (its engine core's, with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and in its worker's.

    python -m tests.plain_engine <model directory>
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.engines import PROMPTS, TOKENS


def looks() -> dict[str, Any]:
    """What vLLM's classes that groupbridge could touch hold, in this process: every name of each, and where
    each of the methods an engine runs was defined."""
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    out: dict[str, Any] = {}
    for cls in (EngineCore, EngineCoreProc, AsyncLLM, WorkerLoRAManager):
        out[cls.__name__] = {name: _where(v) for name, v in vars(cls).items()}
    out["plugin loaded"] = "groupbridge.vllm._plugin" in sys.modules
    return out


def _where(value: Any) -> str:
    """Where a class attribute was defined, and whether something wrapped it (``functools.wraps`` copies the
    name and module of what it wraps)."""
    name = getattr(value, "__qualname__", type(value).__name__)
    wrapped = " (wrapped)" if hasattr(value, "__wrapped__") else ""
    return f"{getattr(value, '__module__', '')}.{name}{wrapped}"


def in_engine(worker: Any) -> dict[str, Any]:
    """The same, in the worker's process (``collective_rpc``)."""
    return looks()


def main(path: str) -> None:
    import vllm

    llm = vllm.LLM(
        path,
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        max_model_len=128,
        max_num_seqs=4,
    )
    sp = vllm.SamplingParams(max_tokens=TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    report = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "here": looks(),
        "engine": llm.collective_rpc(in_engine)[0],
    }
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
