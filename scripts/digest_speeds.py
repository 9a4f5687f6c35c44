"""The bulk digests a weight sync can use, on one 128 MiB buffer in host memory: XXH3 (``checksum=True``
for host tensors), mix64 (the checksum computed where a device's bucket is, here on the CPU: on a device it
runs at the device's speed), keyed BLAKE3 (a sealed group's bucket MAC, on one thread and on every core),
HMAC-SHA256 (the MAC it replaced), beside a memory copy. Best of five, GB/s.

Usage: ``python scripts/digest_speeds.py``.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Callable

import blake3
import torch
import xxhash

from groupbridge.weights._device_digest import checksum64


def _rate(nbytes: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> None:
    buf = torch.randint(0, 256, (128 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(buf)
    data = buf.numpy().data
    key = os.urandom(32)
    rows = {
        "memory copy (torch copy_)": lambda: dst.copy_(buf),
        "XXH3-64 (checksum=True)": lambda: xxhash.xxh3_64_intdigest(data),
        "mix64 (torch ops, one thread)": lambda: checksum64(buf),
        "keyed BLAKE3, one thread (a token)": lambda: blake3.blake3(data, key=key).digest(),
        "keyed BLAKE3, every core": lambda: blake3.blake3(
            data, key=key, max_threads=blake3.blake3.AUTO
        ).digest(),
        "HMAC-SHA256 (a token, before)": lambda: hmac.digest(key, data, "sha256"),
    }
    print(f"{'digest':<36} GB/s   ({os.cpu_count()} cores)")
    for name, fn in rows.items():
        print(f"{name:<36} {_rate(buf.numel(), fn):5.2f}")


if __name__ == "__main__":
    main()
