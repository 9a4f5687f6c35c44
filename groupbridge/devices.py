"""Accelerator detection and the device -> process-group backend map.

A split backend such as ``"cpu:gloo,cuda:nccl"`` lets one world carry CPU tensors over gloo and device tensors
over the vendor library. Building it unconditionally fails on builds that lack the vendor library (a CPU-only
torch has no NCCL), so every string here is derived from what this torch build really has.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_FOR_DEVICE",
    "accelerator",
    "available_backends",
    "backend_available",
    "parse_backend",
    "split_backend",
]

BACKEND_FOR_DEVICE: dict[str, str] = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl", "cpu": "gloo"}
"""The process-group backend each device type uses for its own tensors."""

KNOWN_BACKENDS = ("gloo", "nccl", "hccl", "xccl", "mpi", "ucc")


def _npu_present() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def _cuda_present() -> bool:
    return bool(torch.cuda.is_available())


def _xpu_present() -> bool:
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def accelerator() -> str:
    """The accelerator type this process can use: ``"cuda"``, ``"npu"``, ``"xpu"`` or ``"cpu"``."""
    if _cuda_present():
        return "cuda"
    if _npu_present():
        return "npu"
    if _xpu_present():
        return "xpu"
    return "cpu"


def backend_available(backend: str) -> bool:
    """Whether this torch build has the named process-group backend built in (or registered)."""
    if not dist.is_available():
        return False
    checks = {
        "gloo": dist.is_gloo_available,
        "nccl": dist.is_nccl_available,
        "mpi": dist.is_mpi_available,
        "ucc": dist.is_ucc_available,
    }
    if backend in checks:
        return bool(checks[backend]())
    if backend == "xccl":
        check = getattr(dist, "is_xccl_available", None)
        return bool(check is not None and check())
    # Out-of-tree backends (hccl from torch_npu) register themselves with dist.Backend.
    return backend in getattr(dist.Backend, "backend_list", [])


def available_backends() -> list[str]:
    """The known backends this torch build has, in a stable order."""
    return [b for b in KNOWN_BACKENDS if backend_available(b)]


def split_backend(device: str | torch.device | None = None) -> str:
    """The backend string for a world on ``device`` (default: this process's accelerator).

    Returns ``"cpu:gloo,<device>:<backend>"`` when the device's backend is built into this torch, else
    ``"cpu:gloo"``: CPU collectives then still work, and device collectives fail with torch's own error
    rather than the whole world failing to start.
    """
    kind = accelerator() if device is None else torch.device(device).type
    if kind == "cpu":
        return "cpu:gloo"
    backend = BACKEND_FOR_DEVICE.get(kind)
    if backend is not None and backend_available(backend):
        return f"cpu:gloo,{kind}:{backend}"
    return "cpu:gloo"


def parse_backend(spec: str) -> dict[str, str]:
    """Parse ``"gloo"`` or ``"cpu:gloo,cuda:nccl"`` into a device -> backend map, checking availability.

    A bare backend name maps to every device type that backend serves.

    Raises:
        ValueError: malformed, or naming a backend this build lacks (the message says what works here).
    """
    text = spec.strip().lower()
    if not text:
        raise ValueError("backend='' is empty; pass None to let groupbridge choose")
    mapping: dict[str, str] = {}
    if ":" not in text:
        if text not in KNOWN_BACKENDS:
            raise ValueError(f"backend={spec!r} is not a known backend ({', '.join(KNOWN_BACKENDS)})")
        devices = {"gloo": ["cpu", "cuda"], "mpi": ["cpu", "cuda"], "ucc": ["cpu", "cuda"]}.get(
            text, [d for d, b in BACKEND_FOR_DEVICE.items() if b == text]
        )
        mapping = dict.fromkeys(devices, text)
    else:
        for part in text.split(","):
            device, sep, backend = part.strip().partition(":")
            if not sep or not device or not backend:
                raise ValueError(f"backend={spec!r}: {part!r} is not of the form <device>:<backend>")
            if backend not in KNOWN_BACKENDS:
                raise ValueError(f"backend={spec!r} names unknown backend {backend!r}")
            if device in mapping:
                raise ValueError(f"backend={spec!r} names device {device!r} twice")
            mapping[device] = backend
    missing = sorted({b for b in mapping.values() if not backend_available(b)})
    if missing:
        have = ", ".join(available_backends()) or "none"
        raise ValueError(
            f"backend={spec!r} names {', '.join(missing)}, which this torch build ({torch.__version__}) "
            f"lacks; backends available here: {have}; backend=None would use {split_backend()!r}"
        )
    return mapping
