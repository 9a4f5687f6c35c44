"""Synthetic, real-shaped models for tests and benchmarks: every CPU dtype; the dense and MoE shapes."""

from __future__ import annotations

import torch

ALL_DTYPES = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
]  # fmt: skip


def every_dtype(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for d in ALL_DTYPES:
        base = torch.randn(37, 5, generator=g) * 10
        sd[f"t.{str(d).removeprefix('torch.')}"] = base.to(d) if d != torch.bool else base > 0
    sd["noncontig"] = (torch.randn(8, 6, generator=g) + seed).t()
    sd["empty"] = torch.empty(0, 4)
    sd["scalar"] = torch.tensor(3.5 + seed)
    sd["big"] = torch.randn(3000, generator=g)  # 12 kB: bigger than the 4 kB test buckets
    sd["tied"] = sd["big"]
    return sd


def zeros_like_model(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    ids: dict[int, str] = {}
    for k, v in sd.items():
        if id(v) in ids:
            out[k] = out[ids[id(v)]]
        else:
            ids[id(v)] = k
            out[k] = torch.zeros_like(v.contiguous())
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def dense_shapes(scale: int = 1, layers: int = 24) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-0.5B-like (290 tensors at full size); ``scale`` divides the widths."""
    h, inter, kv, vocab = 896 // scale, 4864 // scale, 128 // scale, 151936 // scale
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
        ]  # fmt: skip
    shapes.append(("model.norm.weight", (h,)))
    return shapes


def moe_shapes(scale: int = 1, layers: int = 16, experts: int = 64) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3-MoE-like, scaled down (3,186 tensors at full size; layers=8 is the half variant)."""
    h, inter, kv, vocab = 1024 // scale, 384 // scale, 256 // scale, 32000 // scale
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate.weight", (experts, h)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
        ]  # fmt: skip
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes += [(q + "gate_proj.weight", (inter, h)), (q + "up_proj.weight", (inter, h)),
                       (q + "down_proj.weight", (h, inter))]  # fmt: skip
    shapes.append(("model.norm.weight", (h,)))
    return shapes


def make_model(
    shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes}
