"""Every sync the weight core runs, over every layout it must carry: one source sending whole tensors, or
three holding different layouts of the same tensors (rows over all three, columns over two, uneven rows over
two, a bias replicated on all; bfloat16, float32 and uint8 mixed); two receivers wanting whole tensors,
column boxes (a tensor-parallel worker), or one of each; each transport that can carry the sync; atomic and
streaming; full syncs and deltas; ``receive_into`` and ``receive()``. Every version is checked bit for bit on
every receiver.

One group per (device, sources, transport, delta): its receivers change what they want between syncs (each
change is planned again), so the matrix costs a few process starts instead of one per cell. It runs on every
device this host has: on a CUDA host the same cases run with every tensor on the GPU, over ``auto`` (CUDA IPC
on one host; NCCL refuses two ranks on one GPU, so the group's own transports need a GPU per member).
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

import groupbridge as gb
from tests.helpers import CTX, make_group, run_ranks

SHAPES = {"w": (48, 64), "v": (64, 30), "e": (51, 32), "q": (40, 24), "b": (64,)}
DTYPES = {"w": torch.bfloat16, "v": torch.float32, "e": torch.bfloat16, "q": torch.uint8, "b": torch.float32}
RECEIVERS = 2
WANTS = {"whole": ("whole", "whole"), "boxes": ("boxes", "boxes"), "one of each": ("whole", "boxes")}
"""What receivers 1 and 2 want, by the name of the case."""
MODES = ("atomic", "streaming", "receive", "receive, kept")
"""``receive_into`` atomic or streaming; ``receive()`` (a receiver wanting boxes takes them atomically), its
tensors of their own or views of the kept buffer, each copied into the target as it is yielded (a delta
yields only what changed: the target keeps the rest)."""
SYNCS_PER_CASE = 2  # per (wants, mode): the second may be a delta against the first


def _full(name: str, version: int, device: str = "cpu") -> torch.Tensor:
    """Version ``version`` of tensor ``name``: a fixed tensor with every fifth value moved per version (so
    that a delta has something to leave out)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(SHAPES[name], generator=g) * 40
    flat = t.view(-1)
    flat[version % 5 :: 5] += float(version)
    return (
        t.abs().to(DTYPES[name]).to(device) if DTYPES[name] is torch.uint8 else t.to(DTYPES[name]).to(device)
    )


def _chunk(t: torch.Tensor, parts: int, i: int, dim: int) -> gb.Shard:
    """Piece i of ``t`` as torch.chunk cuts it (uneven when the size does not divide)."""
    pieces = torch.chunk(t, parts, dim)
    offset = [0] * t.dim()
    offset[dim] = sum(p.shape[dim] for p in pieces[:i])
    return gb.Shard(pieces[i].clone(), tuple(t.shape), tuple(offset))


def _held(rank: int, sources: int, version: int, device: str) -> dict[str, Any]:
    if sources == 1:
        return {name: _full(name, version, device) for name in SHAPES}
    out: dict[str, Any] = {"w": _chunk(_full("w", version, device), sources, rank, 0)}  # rows over all
    if rank < 2:
        out["v"] = _chunk(_full("v", version, device), 2, rank, 1)  # columns over two
        out["q"] = _chunk(_full("q", version, device), 2, rank, 1)  # bytes (quantized), columns over two
        out["e"] = _chunk(_full("e", version, device), 2, rank, 0)  # 51 rows: 26 and 25
    out["b"] = _full("b", version, device)  # a replica on every source
    return {name: out[name] for name in SHAPES if name in out}


def _target(want: str, device: str) -> dict[str, Any]:
    whole = {name: torch.zeros(SHAPES[name], dtype=DTYPES[name], device=device) for name in SHAPES}
    if want == "whole":
        return whole
    boxes: dict[str, Any] = {}
    for name in ("w", "v", "e", "q"):  # the right half of the columns
        rows, cols = SHAPES[name]
        half = torch.zeros(rows, cols - cols // 2, dtype=DTYPES[name], device=device)
        boxes[name] = gb.Shard(half, (rows, cols), (0, cols // 2))
    boxes["b"] = whole["b"]
    return boxes


def _exact(target: dict[str, Any], version: int) -> bool:
    for name, value in target.items():
        want = _full(name, version).to(_device_of(value))
        if isinstance(value, gb.Shard):
            got, want = value.tensor, want[value.box.slices([0] * want.dim())]
        else:
            got = value
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False
    return True


def _device_of(value: Any) -> torch.device:
    return value.tensor.device if isinstance(value, gb.Shard) else value.device


def _cases() -> list[tuple[str, str, int]]:
    """(wants, mode, version) in the order every member walks them."""
    out, version = [], 0
    for wants in WANTS:
        for mode in MODES:
            for _ in range(SYNCS_PER_CASE):
                version += 1
                out.append((wants, mode, version))
    return out


def _member(rank: int, ports: Any, sources: int, transport: str, delta: bool, device: str) -> Any:
    n = sources + RECEIVERS
    with make_group(rank, n, "127.0.0.1", ports) as g:
        if rank < sources:
            with gb.WeightSender(g, transport=transport, delta="always" if delta else False) as snd:
                stats = [snd.send(_held(rank, sources, v, device), version=v) for _, _, v in _cases()]
                return [(s.transport, s.delta) for s in stats]
        rcv = gb.WeightReceiver(g, device=device)
        out, targets = [], {}
        for wants, mode, version in _cases():  # a target lives as long as its case (a delta's base)
            want = WANTS[wants][rank - sources]
            target = targets.setdefault((wants, mode), _target(want, device))
            if mode.startswith("receive") and want == "whole":
                for name, t in rcv.receive(keep=mode.endswith("kept")):
                    target[name].copy_(t)
                held = rcv.version
            else:
                held = rcv.receive_into(target, atomic=mode != "streaming")
            out.append((wants, mode, held, _exact(target, version)))
        return out


ONE_SOURCE = ["auto", "shm", "p2p", "broadcast", "relay"]
THREE_SOURCES = ["auto", "shm", "p2p"]
CASES = [("cpu", 1, t) for t in ONE_SOURCE] + [("cpu", 3, t) for t in THREE_SOURCES]
if torch.cuda.is_available():
    CASES += [("cuda", 1, "auto"), ("cuda", 3, "auto")]
    if torch.cuda.device_count() >= 3 + RECEIVERS:  # NCCL: a GPU per member
        CASES += [("cuda", s, t) for s, t in ((1, "p2p"), (1, "broadcast"), (3, "p2p"))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
@pytest.mark.parametrize(
    ("device", "sources", "transport"), CASES, ids=[f"{d}-{s}-source{'s' * (s > 1)}-{t}" for d, s, t in CASES]
)
def test_every_layout_lands_bit_exact(device: str, sources: int, transport: str, delta: bool) -> None:
    res = run_ranks(_member, sources + RECEIVERS, CTX.Queue(), sources, transport, delta, device, timeout=110)
    for got in res[sources:]:
        wrong = [
            (w, m, v)
            for (w, m, held, exact), (_, _, v) in zip(got, _cases(), strict=True)
            if not exact or held != v
        ]
        assert not wrong, f"not bit-exact (wants, mode, version): {wrong}\n{got}"
    for sent in res[:sources]:
        if transport in ("shm", "p2p"):
            assert {t for t, _ in sent} == {transport}, sent
        if delta:  # the second sync of every case is a delta against the first
            assert all(
                d for (_, d), (_, _, v) in zip(sent, _cases(), strict=True) if v % SYNCS_PER_CASE == 0
            ), sent
