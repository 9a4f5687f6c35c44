from __future__ import annotations

import pytest
import torch

import groupbridge as gb
from groupbridge import devices


def test_real_answer_on_this_build() -> None:
    if torch.cuda.is_available():
        pytest.skip("this test states the CPU-only answer; this machine has CUDA")
    assert gb.accelerator() == "cpu"
    assert gb.split_backend() == "cpu:gloo"
    assert gb.split_backend("cpu") == "cpu:gloo"
    if not torch.distributed.is_nccl_available():
        # the bug this module exists for: a CPU-only build must never be handed nccl
        assert gb.split_backend("cuda") == "cpu:gloo"


@pytest.mark.parametrize(
    ("present", "available", "expected_acc", "expected_split"),
    [
        ("cuda", {"nccl"}, "cuda", "cpu:gloo,cuda:nccl"),
        ("cuda", set(), "cuda", "cpu:gloo"),
        ("npu", {"hccl"}, "npu", "cpu:gloo,npu:hccl"),
        ("npu", set(), "npu", "cpu:gloo"),
        ("xpu", {"xccl"}, "xpu", "cpu:gloo,xpu:xccl"),
        ("xpu", set(), "xpu", "cpu:gloo"),
        (None, {"nccl"}, "cpu", "cpu:gloo"),
    ],
)
def test_each_branch(
    monkeypatch: pytest.MonkeyPatch,
    present: str | None,
    available: set[str],
    expected_acc: str,
    expected_split: str,
) -> None:
    monkeypatch.setattr(devices, "_cuda_present", lambda: present == "cuda")
    monkeypatch.setattr(devices, "_npu_present", lambda: present == "npu")
    monkeypatch.setattr(devices, "_xpu_present", lambda: present == "xpu")
    monkeypatch.setattr(devices, "backend_available", lambda b: b == "gloo" or b in available)
    assert devices.accelerator() == expected_acc
    assert devices.split_backend() == expected_split


def test_cuda_preferred_over_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_cuda_present", lambda: True)
    monkeypatch.setattr(devices, "_npu_present", lambda: True)
    assert devices.accelerator() == "cuda"


def test_backend_map() -> None:
    assert devices.BACKEND_FOR_DEVICE == {"cuda": "nccl", "npu": "hccl", "xpu": "xccl", "cpu": "gloo"}


def test_parse_backend() -> None:
    assert devices.parse_backend("cpu:gloo") == {"cpu": "gloo"}
    assert devices.parse_backend("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    for bad in ["", "cpu:", "cpu:gloo,cpu:gloo", "cpu:foo", "foo"]:
        with pytest.raises(ValueError):
            devices.parse_backend(bad)


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this build has NCCL")
def test_missing_backend_message() -> None:
    with pytest.raises(ValueError) as info:
        devices.parse_backend("cpu:gloo,cuda:nccl")
    msg = str(info.value)
    assert "nccl" in msg and "lacks" in msg and "gloo" in msg and "'cpu:gloo'" in msg
