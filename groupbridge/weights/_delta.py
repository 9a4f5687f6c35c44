"""Delta encoding of one bucket: what changed between the version a receiver holds and the new one.

Buckets are compared bitwise, as words of the bucket's smallest element size (every dtype works; a NaN whose
payload changes or a 0.0 that becomes -0.0 is a change), and travel as whichever is smallest (sizes follow
from the changed-word count alone, so the receiver computes them and never trusts a size off the wire):

- ``SAME``: nothing changed, nothing travels;
- ``GAPS``: the changed positions as uint16 gaps from the previous one (the first from -1), then the new
  words; taken when every gap fits in 16 bits (changes dense enough: a few percent of a bucket or more);
- ``INDEX``: the positions as int32, then the new words (sparse changes whose gaps overflow 16 bits);
- ``BITS``: a bitmap of changed words (little-endian), then the new words (beyond about 1 in 16 changed);
- ``DENSE``: the new bucket as is, when most words changed.

CPU buckets are diffed with numpy on views of the same memory: its comparison, ``flatnonzero`` and
``packbits`` measured about twice as fast as torch's (whose ``nonzero`` dominates) on this machine kind
(2 cores, one bucket diffed in a loop); other devices use torch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ProtocolError
from .manifest import Manifest
from .plan import Plan


class Code(enum.IntEnum):
    SAME = 0
    DENSE = 1
    GAPS = 2
    INDEX = 3
    BITS = 4


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_WORD: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def word_size(plan: Plan, manifest: Manifest, k: int) -> int:
    """The comparison word of bucket ``k``: its smallest element size, reduced until it divides the bucket's
    stream offset and length (so the bucket can be viewed as words wherever it lies)."""
    start, end = plan.bucket_range(k)
    w = min((manifest.entries[s.index].element_size for s in plan.buckets[k]), default=1)
    w = min(w, 8)
    while w > 1 and (start % w or (end - start) % w):
        w //= 2
    return w


def payload_nbytes(code: Code, count: int, words: int, w: int) -> int:
    """Bytes of a bucket's payload with ``count`` of its ``words`` words changed."""
    if code is Code.SAME:
        return 0
    if code is Code.DENSE:
        return words * w
    return head_nbytes(code, count, words) + count * w


def head_nbytes(code: Code, count: int, words: int) -> int:
    """Bytes of the positions (or bitmap) before the new words, padded to 8 so the words stay aligned."""
    raw = {Code.GAPS: 2 * count, Code.INDEX: 4 * count, Code.BITS: (words + 7) // 8}.get(code, 0)
    return -(-raw // 8) * 8


@dataclass(frozen=True, slots=True)
class Encoded:
    code: Code
    count: int
    """Changed words."""
    words: int
    payload: torch.Tensor | None
    """uint8 bytes to send (None for SAME and DENSE: a dense bucket travels from the base itself)."""


def encode(new: torch.Tensor, base: torch.Tensor, w: int, mask: torch.Tensor | None = None) -> Encoded:
    """Encode ``new`` against ``base`` (uint8 views of one bucket) and bring ``base`` up to ``new``'s bytes.
    ``mask``: a reusable bool buffer of at least the bucket's word count (a fresh one costs page faults)."""
    words = new.numel() // w
    if new.device.type == "cpu":
        buf = mask.numpy() if mask is not None else None
        return _encode_np(new.numpy().view(_NP_WORD[w]), base.numpy().view(_NP_WORD[w]), w, words, buf)
    return _encode_torch(new.view(_WORD[w]), base.view(_WORD[w]), w, words)


def _choose(count: int, words: int, w: int) -> Code:
    if count == 0:
        return Code.SAME
    return min((Code.DENSE, Code.GAPS, Code.BITS), key=lambda c: (payload_nbytes(c, count, words, w), c))


def _index_or_bits(count: int, words: int, w: int) -> Code:
    """What GAPS falls back to when a gap overflows 16 bits: the smaller of INDEX and BITS."""
    index = payload_nbytes(Code.INDEX, count, words, w) < payload_nbytes(Code.BITS, count, words, w)
    return Code.INDEX if index else Code.BITS


def _encode_np(new: np.ndarray, base: np.ndarray, w: int, words: int, mask_buf: np.ndarray | None) -> Encoded:
    if mask_buf is not None and mask_buf.size >= words:
        mask = np.not_equal(new, base, out=mask_buf[:words])
    else:
        mask = np.not_equal(new, base)
    count = int(np.count_nonzero(mask))
    code = _choose(count, words, w)
    payload: np.ndarray | None = None
    if code is Code.GAPS:
        pos = np.flatnonzero(mask)
        gaps = np.diff(pos, prepend=-1)
        if int(gaps.max()) <= 0xFFFF:
            payload = np.concatenate(
                [_padded_np(gaps.astype(np.uint16).view(np.uint8)), new[pos].view(np.uint8)]
            )
        else:
            code = _index_or_bits(count, words, w)
            if code is Code.INDEX:
                payload = np.concatenate(
                    [_padded_np(pos.astype(np.int32).view(np.uint8)), new[pos].view(np.uint8)]
                )
    if code is Code.BITS:
        payload = np.concatenate([_padded_np(np.packbits(mask, bitorder="little")), new[mask].view(np.uint8)])
    if code is not Code.SAME:
        np.copyto(base, new)  # a plain copy beats a masked one (or a scatter) from about 1% changed
    return Encoded(code, count, words, None if payload is None else torch.from_numpy(payload))


def _encode_torch(new: torch.Tensor, base: torch.Tensor, w: int, words: int) -> Encoded:
    mask = new != base
    count = int(torch.count_nonzero(mask))
    code = _choose(count, words, w)
    payload: torch.Tensor | None = None
    if code is Code.GAPS:
        pos = mask.nonzero().view(-1)
        gaps = torch.diff(pos, prepend=pos.new_full((1,), -1))
        if int(gaps.max()) <= 0xFFFF:
            payload = torch.cat(
                [_padded(_bytes_of(gaps.to(torch.int16))), _bytes_of(new[pos])]
            )  # wraps to uint16 bits
        else:
            code = _index_or_bits(count, words, w)
            if code is Code.INDEX:
                payload = torch.cat([_padded(_bytes_of(pos.to(torch.int32))), _bytes_of(new[pos])])
    if code is Code.BITS:
        payload = torch.cat([_padded(_packbits(mask)), _bytes_of(new[mask])])
    if code is Code.DENSE:
        base.copy_(new)
    elif code is not Code.SAME:
        base[mask] = new[mask]
    return Encoded(code, count, words, payload)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _padded(head: torch.Tensor) -> torch.Tensor:
    pad = (-head.numel()) % 8
    return torch.cat([head, head.new_zeros(pad)]) if pad else head


def _padded_np(head: np.ndarray) -> np.ndarray:
    pad = (-head.size) % 8
    return np.concatenate([head, np.zeros(pad, np.uint8)]) if pad else head


_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    pad = (-mask.numel()) % 8
    m = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    m = m.view(-1, 8).to(torch.uint8)
    out = m[:, 0].clone()
    for j in range(1, 8):
        out |= m[:, j] << j
    return out


def _unpackbits(bits: torch.Tensor, words: int) -> torch.Tensor:
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    return (bits.unsqueeze(1) & weights).ne(0).view(-1)[:words]


def apply(base: torch.Tensor, payload: torch.Tensor, code: Code, count: int, w: int) -> torch.Tensor:
    """Apply one bucket's payload, as it came off the wire, to ``base`` (its uint8 view) in place; return the
    changed word positions (int64, sorted). A malformed payload raises :class:`ProtocolError` before
    anything is written."""
    words = base.numel() // w
    if not 0 <= count <= words:
        raise ProtocolError(f"delta bucket claims {count} changed words of {words}")
    need = payload_nbytes(code, count, words, w)
    if payload.numel() != need:
        raise ProtocolError(f"delta bucket payload is {payload.numel()} bytes; {code.name} needs {need}")
    if code is Code.SAME:
        return torch.empty(0, dtype=torch.int64)
    if code is Code.DENSE:
        base.copy_(payload)
        return torch.arange(words, dtype=torch.int64)
    if base.device.type == "cpu":
        pos = _apply_np(base.numpy().view(_NP_WORD[w]), payload.cpu().numpy(), code, count, words, w)
        return torch.from_numpy(pos)
    return _apply_torch(base.view(_WORD[w]), payload.to(base.device), code, count, words, w)


def _apply_np(
    base: np.ndarray, payload: np.ndarray, code: Code, count: int, words: int, w: int
) -> np.ndarray:
    head = head_nbytes(code, count, words)
    if code is Code.BITS:
        mask = np.unpackbits(payload[:head], count=words, bitorder="little").view(bool)
        if int(np.count_nonzero(mask)) != count:
            raise ProtocolError("delta bucket bitmap does not hold the number of changes it claims")
        np.place(base, mask, payload[head:].view(base.dtype))
        return np.flatnonzero(mask)
    if code is Code.GAPS:
        gaps = payload[: 2 * count].view(np.uint16)
        pos = np.cumsum(gaps, dtype=np.int64) - 1
        if count and (int(pos[-1]) >= words or int(gaps.min()) == 0):
            raise ProtocolError("delta bucket positions are out of range or repeated")
    else:
        pos = payload[: 4 * count].view(np.int32).astype(np.int64)
        if count and (int(pos.min()) < 0 or int(pos.max()) >= words or not bool(np.all(np.diff(pos) > 0))):
            raise ProtocolError("delta bucket positions are out of range or not increasing")
    base[pos] = payload[head:].view(base.dtype)
    return pos


def _apply_torch(
    base: torch.Tensor, payload: torch.Tensor, code: Code, count: int, words: int, w: int
) -> torch.Tensor:
    dtype, head = base.dtype, head_nbytes(code, count, words)
    if code is Code.BITS:
        mask = _unpackbits(payload[:head], words)
        if int(torch.count_nonzero(mask)) != count:
            raise ProtocolError("delta bucket bitmap does not hold the number of changes it claims")
        base[mask] = payload[head:].view(dtype)
        return mask.nonzero().view(-1)
    if code is Code.GAPS:
        gaps = payload[: 2 * count].view(torch.int16).to(torch.int64) & 0xFFFF
        pos = gaps.cumsum(0) - 1
        if count and (int(pos[-1]) >= words or int(gaps.min()) == 0):
            raise ProtocolError("delta bucket positions are out of range or repeated")
    else:
        pos = payload[: 4 * count].view(torch.int32).to(torch.int64)
        if count and (int(pos.min()) < 0 or int(pos.max()) >= words or not bool((pos.diff() > 0).all())):
            raise ProtocolError("delta bucket positions are out of range or not increasing")
    base[pos] = payload[head:].view(dtype)
    return pos


def spans_hit(positions: torch.Tensor, spans: Sequence[tuple[int, int]], w: int) -> list[bool]:
    """For each (byte offset, bytes) span of a bucket, whether one of the changed word ``positions``
    (sorted) falls in it (spans start and end on word boundaries)."""
    pos = positions.cpu()
    starts = torch.tensor([offset // w for offset, _ in spans], dtype=torch.int64)
    ends = torch.tensor([(offset + n) // w for offset, n in spans], dtype=torch.int64)
    return (torch.searchsorted(pos, ends) > torch.searchsorted(pos, starts)).tolist()
