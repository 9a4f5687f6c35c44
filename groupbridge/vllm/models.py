"""Small models made locally from a ``transformers`` config (random weights, no download), saved where vLLM
can load them: what the tests, the benchmark, the example and a first try of the quickstart run on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # a few MiB: engine start-up dominates; head_dim 64 is one vLLM's CPU attention supports
    "tiny": {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
    },
    # the dense benchmark shape (Qwen2.5-0.5B): 0.92 GiB in bf16, 290 tensors
    "bench": {
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "vocab_size": 151936,
        "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
    },
}  # fmt: skip


def make_model(
    path: str | Path,
    arch: str = "qwen2",
    size: str = "tiny",
    *,
    dtype: str = "float32",
    seed: int = 0,
    tie: bool | None = None,
    max_positions: int = 512,
) -> Any:
    """Build a random ``arch`` model (``"qwen2"``: dense, fused qkv and gate_up in vLLM; ``"qwen3_moe"``:
    fused experts) of ``size`` (see :data:`SHAPES`), save it at ``path`` and return the ``transformers``
    model. ``max_positions`` bounds the ``max_model_len`` an engine may serve it with.

    Weights are drawn with a larger spread than ``transformers``' default so that greedy tokens differ
    from one version to the next (a random model with tiny weights repeats one token forever).
    """
    import transformers

    shape = dict(SHAPES[size])
    if tie is not None:  # the output projection shares the embedding (as in Qwen2.5-0.5B)
        shape["tie_word_embeddings"] = tie
    common = dict(head_dim=64, max_position_embeddings=max_positions, initializer_range=0.2, **shape)
    if arch == "qwen2":
        config: Any = transformers.Qwen2Config(**common)
        cls: Any = transformers.Qwen2ForCausalLM
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            moe_intermediate_size=shape["intermediate_size"]
            // 8,  # 2 x it != hidden: a transposed load cannot fit
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(f"arch={arch!r} is not one of qwen2, qwen3_moe")
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(str(path))
    return model
