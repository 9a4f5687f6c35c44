"""A bucket's checksum computed where the bucket is, with torch operations: the same function on every
device, the same value for the same bytes.

XXH3 runs on the host: a bucket on an accelerator would first be copied to host memory, the whole model
every sync. This checksum runs as a handful of elementwise integer operations and one sum on the bucket's
own device, so a device bucket never leaves it.

The function, on the bucket's bytes read as little-endian 64-bit words ``w_0 .. w_{m-1}`` (the last one
padded with zero bytes), ``n`` the byte length (the words are read in the host's byte order: little-endian
on every CPU and device torch's accelerators run beside; a big-endian host would compute another value)::

    checksum = (sum over i of mix(w_i + (i + 1) * GOLDEN)) + mix(n) mod 2**64

where ``mix`` is splitmix64's finalizer (two multiplications by odd constants and three xor-shifts: a
bijection of 64-bit words, each output bit depending on every input bit). Addition modulo 2**64 is
associative and commutative, so the value does not depend on how a device splits the sum, and torch's
int64 arithmetic wraps modulo 2**64 on every device. A changed word changes its term to an unrelated
value, a word moved changes the position it is mixed with, and the length is mixed in apart: corruption,
truncation and reordering are caught except with probability about 2**-64 per bucket. It is a checksum, not
a MAC: whoever may change the bytes can compute it too (a sealed group authenticates its buckets otherwise,
see ``groupbridge._seal``).
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_WORDS", "checksum64", "reference_checksum64"]

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
CHUNK_WORDS = 1 << 22
"""Words mixed at a time (32 MiB of bucket): bounds the temporaries at a few times that."""


def _signed(v: int) -> int:
    """A 64-bit word as the int64 that holds its bits."""
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch shifts int64 arithmetically: mask the sign's copies)."""
    return torch.bitwise_and(torch.bitwise_right_shift(z, k), (1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, in place on int64 words (wrapping multiplication)."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_signed(_M1))
    z.bitwise_xor_(_shr(z, 27)).mul_(_signed(_M2))
    return z.bitwise_xor_(_shr(z, 31))


def _mix_int(v: int) -> int:
    v &= MASK
    v = ((v ^ (v >> 30)) * _M1) & MASK
    v = ((v ^ (v >> 27)) * _M2) & MASK
    return v ^ (v >> 31)


def checksum64(buf: torch.Tensor) -> int:
    """The checksum of ``buf`` (uint8, one dimension, any device) described in the module docstring,
    computed on ``buf``'s device; only the 8-byte result reaches the host."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"checksum64 takes a contiguous 1-D uint8 tensor, got {buf.dtype} of shape {list(buf.shape)}"
        )
    n = buf.numel()
    full = n // 8
    total = torch.zeros((), dtype=torch.int64, device=buf.device)
    with torch.no_grad():
        for start in range(0, full, CHUNK_WORDS):
            stop = min(start + CHUNK_WORDS, full)
            part = buf[start * 8 : stop * 8]
            if part.data_ptr() % 8:  # bytes that start between words: an aligned copy, on the device
                part = part.clone()
            words = part.view(torch.int64)
            pos = torch.arange(start + 1, stop + 1, dtype=torch.int64, device=buf.device)
            total += _mix(pos.mul_(_signed(GOLDEN)).add_(words)).sum()
        if n % 8:
            tail = torch.zeros(8, dtype=torch.uint8, device=buf.device)
            tail[: n % 8] = buf[full * 8 :]
            word = tail.view(torch.int64) + _signed((full + 1) * GOLDEN)
            total += _mix(word).sum()
    return (int(total.item()) + _mix_int(n)) & MASK


def reference_checksum64(data: bytes) -> int:
    """The same checksum in plain Python, word by word: the definition the tensor version is tested
    against."""
    n = len(data)
    padded = data + bytes(-n % 8)
    total = 0
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[i * 8 : i * 8 + 8], "little")
        total += _mix_int(word + (i + 1) * GOLDEN)
    return (total + _mix_int(n)) & MASK
