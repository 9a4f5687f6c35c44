"""The handshake and plan of a many-source sync at the size of real jobs, one member's share at a time.

Real models' tensor inventories are built on the meta device from their ``transformers`` configs (no
download); real layouts are laid over them: the trainer's FSDP over S ranks, with expert parallelism where
the model has experts (the fused experts' first dimension over EP ranks, their second over the FSDP ranks
of an EP group, every other tensor's rows over all S), and R replicas of a vLLM-like tensor-parallel engine
of TP 8 (column-parallel weights by rows, row-parallel ones by columns, experts by expert, norms whole).

Every member's post is built as its handle builds it (``Posts.post`` over ``boxes_of`` or ``wants_of``),
encoded field by field and combined as rank 0 combines them (``all_gather_obj(by_field=True)``); then, for a
sample of members, this process times what that member computes from the combined value: decoding it,
reading the posts, the headers and manifests, and its share of the plan (``plan_pairs``), on the first sync
and on a repeat one (posts by digest, the plan found by its key). Network waits are not in it: the figure
is a member's CPU, which on a cluster (each member its own cores) is the handshake's cost.

The sample covers every kind of member: source ranks 0 (the gather's root), 1, the middle one and the last
(the uneven tail of every ``torch.chunk``), and the first replica's receiver of every tensor-parallel rank
(every replica's receivers post the same layouts as the first's). Members of one kind do the same work, so
the sample's worst is the job's worst.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .. import codec
from ..weights._header import Header, Verdict
from ..weights._posts import Posts, header_fields, header_of
from ..weights._session import _manifest, sources_of
from ..weights._sharded import boxes_of, conditional, plan_pairs
from ..weights.manifest import Entry, Manifest
from ..weights.plan import Plans

__all__ = ["MODELS", "ScaleConfig", "run_scale"]

MODELS = ("llama-3-70b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2")
TP = 8
COLUMN = (
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "q_b_proj",
    "kv_b_proj",
    "embed_tokens",
    "lm_head",
    "q_a_proj",
)
ROW = ("o_proj", "down_proj")


def inventory(model: str) -> dict[str, tuple[int, ...]]:
    """``model``'s tensors (name -> shape), built on the meta device from its config."""
    import torch
    import transformers as tf

    configs: dict[str, Any] = {
        "llama-3-70b": lambda: tf.LlamaConfig(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
        "qwen3-235b-a22b": lambda: tf.Qwen3MoeConfig(
            hidden_size=4096,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
        ),
        "deepseek-v3": lambda: tf.DeepseekV3Config(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            n_shared_experts=1,
            first_k_dense_replace=3,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            v_head_dim=128,
            qk_nope_head_dim=128,
            vocab_size=129280,
            num_experts_per_tok=8,
        ),
        "kimi-k2": lambda: tf.DeepseekV3Config(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=64,
            num_key_value_heads=64,
            n_routed_experts=384,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            v_head_dim=128,
            qk_nope_head_dim=128,
            vocab_size=163840,
            num_experts_per_tok=8,
        ),
    }
    with torch.device("meta"):
        module = tf.AutoModelForCausalLM.from_config(configs[model]())
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


@dataclass(kw_only=True)
class ScaleConfig:
    model: str = "kimi-k2"
    sources: int = 256
    replicas: int = 16
    ep: int = 8
    """Expert parallelism of the trainer (where the model has experts): EP x FSDP = sources."""


def _chunk(size: int, n: int, i: int) -> tuple[int, int]:
    step = -(-size // n)
    start = min(i * step, size)
    return start, max(0, min(step, size - start))


def _expert(name: str, shape: tuple[int, ...]) -> bool:
    return ".experts." in name and len(shape) == 3


def _source_box(
    name: str, shape: tuple[int, ...], rank: int, cfg: ScaleConfig
) -> tuple[list[int], list[int]]:
    """(offset, size) of source ``rank``'s box of ``name``."""
    offset, size = [0] * len(shape), list(shape)
    if _expert(name, shape):
        fsdp = cfg.sources // cfg.ep
        offset[0], size[0] = _chunk(shape[0], cfg.ep, rank // fsdp)
        offset[1], size[1] = _chunk(shape[1], fsdp, rank % fsdp)
    elif shape:
        offset[0], size[0] = _chunk(shape[0], cfg.sources, rank)
    return offset, size


def _want_box(name: str, shape: tuple[int, ...], tp: int) -> tuple[list[int], list[int]]:
    offset, size = [0] * len(shape), list(shape)
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if _expert(name, shape) or (len(shape) == 2 and leaf in COLUMN):
        offset[0], size[0] = _chunk(shape[0], TP, tp)
    elif len(shape) == 2 and leaf in ROW:
        offset[1], size[1] = _chunk(shape[1], TP, tp)
    return offset, size


def _posts(
    shapes: dict[str, tuple[int, ...]],
    cfg: ScaleConfig,
    version: int,
    memories: dict[int, Posts],
) -> list[dict[str, Any]]:
    """Every member's post, as its handle builds it (``memories``: each member's handle, across syncs)."""
    posts = []
    for rank in range(cfg.sources):
        boxes = {n: _source_box(n, s, rank, cfg) for n, s in shapes.items()}
        manifest = Manifest(
            tuple(Entry(n, tuple(sz), "bfloat16", "bfloat16", None) for n, (_, sz) in boxes.items())
        )
        shards = {n: (shapes[n], tuple(o)) for n, (o, _) in boxes.items()}
        total = sum(2 * math.prod(sz) for _, sz in boxes.values())
        header = Header(
            version,
            manifest.digest,
            64 << 20,
            64 << 20,
            "p2p",
            "",
            total,
            f"{rank:012x}",
            {},
            {},
            bucket_cap=64 << 20,
        )
        h, hs = header_fields(header.to_wire())
        posts.append(
            memories[rank].post(
                {"h": h}, {"hs": hs, "manifest": manifest.to_wire(), **boxes_of(shards, manifest)}
            )
        )
    for r in range(cfg.replicas * TP):
        wants = {n: ["bfloat16", list(s), *_want_box(n, s, r % TP)] for n, s in shapes.items()}
        posts.append(memories[cfg.sources + r].post({}, {"wants": wants}))
    return posts


def _combined(posts: list[dict[str, Any]]) -> tuple[bytes, list[int]]:
    """Rank 0's combined value of the handshake's gather, and each member's own post's size."""
    distinct: dict[bytes, int] = {}
    index, sizes = [], []
    for post in posts:
        parts = [codec.encode(list(post)), *(codec.encode(v) for v in post.values())]
        sizes.append(len(msgpack.packb(parts)))
        index.append([distinct.setdefault(p, len(distinct)) for p in parts])
    return msgpack.packb([list(distinct), index]), sizes


class _Group:
    """What ``sources_of`` reads of a group (for its messages)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.name = rank, "scale"


def _member(
    raw: bytes, me: int, posts: list[dict[str, Any]], memory: Posts, plans: Plans
) -> tuple[float, int]:
    """One member's CPU seconds from the combined value to its share of the plan, and its pairs."""
    t0 = time.process_time()
    values, index = msgpack.unpackb(raw, max_bin_len=len(raw), max_array_len=1 << 24)
    decoded = [codec.decode(v) for v in values]
    gathered = []
    for r, ix in enumerate(index):
        if r == me:
            gathered.append(posts[me])
            continue
        parts = [decoded[i] for i in ix]
        gathered.append(dict(zip(parts[0], parts[1:], strict=True)))
    full = memory.read(gathered, me)
    sources = sources_of(_Group(me), full, None)  # type: ignore[arg-type]
    full, _ = conditional(full, sources)
    headers = {s: Header.from_wire(header_of(full[s])) for s in sources}
    manifests = {s: _manifest(memory, full[s], headers[s], s, None) for s in sources}
    for m in manifests.values():
        memory.remember(m)
    plan, _, _ = plan_pairs(full, sources, headers, manifests, me, plans)
    Verdict(fan=len({d for (s, d) in plan.pairs if s == me})).to_wire()
    return time.process_time() - t0, len(plan.pairs)


def run_scale(cfg: ScaleConfig) -> dict[str, Any]:
    """One row: the sample's worst member, first sync and repeat, with bytes and store operations."""
    shapes = inventory(cfg.model)
    n = cfg.sources + cfg.replicas * TP
    memories = {r: Posts(_FakeGroup()) for r in range(n)}  # type: ignore[arg-type]
    sample = sorted({0, 1, cfg.sources // 2, cfg.sources - 1, *range(cfg.sources, cfg.sources + TP)})
    first_posts = _posts(shapes, cfg, 1, memories)
    first_raw, first_sizes = _combined(first_posts)
    for r, memory in memories.items():
        memory.posted(first_posts[r])
    repeat_posts = _posts(shapes, cfg, 2, memories)  # every layout unchanged: digests
    repeat_raw, repeat_sizes = _combined(repeat_posts)
    cpu: dict[str, dict[int, float]] = {"first": {}, "repeat": {}}
    pairs: dict[str, dict[int, int]] = {"first": {}, "repeat": {}}
    for me in sample:
        # one member at a time, as its own process would: its handle, its plans, nothing of the others'
        gc.collect()
        plans = Plans()
        cpu["first"][me], pairs["first"][me] = _member(first_raw, me, first_posts, memories[me], plans)
        cpu["repeat"][me], pairs["repeat"][me] = _member(repeat_raw, me, repeat_posts, memories[me], plans)
        del plans
    rows = {}
    for sync, raw, sizes in (("first", first_raw, first_sizes), ("repeat", repeat_raw, repeat_sizes)):
        worst = max(cpu[sync], key=lambda m: cpu[sync][m])
        worst_source = max((m for m in cpu[sync] if m < cfg.sources), key=lambda m: cpu[sync][m])
        rows[sync] = {
            "cpu_s": cpu[sync][worst],
            "worst_rank": worst,
            "fetched_bytes": len(raw),
            "posted_bytes": max(sizes),
            "pairs": pairs[sync][worst],
            "source_cpu_s": cpu[sync][worst_source],
            "by_rank": {str(m): round(cpu[sync][m], 4) for m in sample},
        }
    return {
        "model": cfg.model,
        "tensors": len(shapes),
        "sources": cfg.sources,
        "receivers": cfg.replicas * TP,
        "ep": cfg.ep,
        "members": n,
        "first": rows["first"],
        "repeat": rows["repeat"],
        # per gather: each member posts once and reads once; rank 0 reads every post in one request
        "store_ops_per_member": 2,
        "store_ops_rank0": 2 + 1,
    }


class _FakeGroup:
    """A group's memory without a group: each simulated member's handle keeps its own."""

    def __init__(self) -> None:
        self.memory: dict[str, Any] = {}


SIZES = (64, 128, 256, 512)


def run_scale_rows(
    quick: bool = False, replicas: int = 16, progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """``bench --scale``'s rows: every model at every trainer size (quick: one model at two small sizes,
    into 4 replicas)."""
    models, sizes = (("llama-3-70b",), (32, 64)) if quick else (MODELS, SIZES)
    rows = []
    for model in models:
        for sources in sizes:
            rows.append(
                run_scale(ScaleConfig(model=model, sources=sources, replicas=4 if quick else replicas))
            )
            r = rows[-1]
            first, repeat = r["first"]["cpu_s"], r["repeat"]["cpu_s"]
            if progress is not None:
                progress(
                    f"[bench] {model} {sources} -> {r['receivers']}: first {first:.3f} s, repeat "
                    f"{repeat * 1e3:.1f} ms"
                )
    return rows
