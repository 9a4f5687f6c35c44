"""A source's side of a full stream: pull, pack and post every bucket of the plan, pipelined.

For each bucket: the source's tensors it needs are pulled (a lazy source yields them one at a time), the
bucket is taken straight from their storage when they lie in the plan's layout, else packed (on the copy
thread) into the transport's buffer, or into the kept base when the source keeps one for deltas; then
posted. The transport's ``buffer()`` blocks while the buffer is still in flight: that is the pipeline's
back-pressure. Tensors are released as soon as their last bucket is posted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from . import _bytes
from ._copier import Copier
from ._delta_sync import Policy
from ._session import Stream
from ._source import Puller
from .transports import TxTransport

__all__ = ["Progress", "SentFull", "send_full"]

Progress = Callable[[int, int], None]
"""``progress(bytes_sent, total_bytes)``, called after every bucket."""


@dataclass(frozen=True, slots=True)
class SentFull:
    in_place: int
    """Buckets posted straight from the tensors' own storage."""
    digests: list[int | bytes]
    """Every bucket's digest, when the header asks for them."""


def send_full(
    tx: TxTransport,
    stream: Stream,
    puller: Puller,
    copier: Copier,
    *,
    digest: Callable[[torch.Tensor], int | bytes] | None,
    base: torch.Tensor | None = None,
    sample: Callable[[torch.Tensor, int], None] | None = None,
    progress: Progress | None = None,
) -> SentFull:
    """Send every bucket of ``stream.plan``. With ``base`` (the source keeps one for deltas) each bucket is
    also written there, packed there rather than into the transport's buffer (one copy, not two); with
    ``sample``, one bucket of at least half the sample size is brought up to date by ``sample(view, k)``
    instead (which times a diff on the way)."""
    plan = stream.plan
    device = stream.device
    tx.open(plan, device, stream.sync)
    live = puller.live
    digests: list[int | bytes] = []
    in_place = 0
    for k, segs in enumerate(plan.buckets):
        puller.pull_through(max(seg.index for seg in segs))
        start, end = plan.bucket_range(k)
        view = _bytes.in_place_bucket(plan, k, puller.direct, receiving=False)
        if view is not None:
            in_place += 1
            if base is not None:
                copier.copy(base[start:end], view)
        elif base is not None and sample is not None and end - start >= Policy.SAMPLE_BYTES // 2:
            view = base[start:end]
            copier.run(partial(sample, view, k))
            sample = None  # one bucket per full sync
        else:
            # a kept base is where the bucket is packed (one copy, not two); else the transport's buffer
            view = base[start:end] if base is not None else tx.buffer(k, end - start, device)
            copier.run(partial(_bytes.pack, view, segs, live, puller.wire))
        if digest is not None:
            digests.append(digest(view))
        tx.post(k, view)
        if progress is not None:
            progress(end, plan.total_bytes)
        puller.release(plan, k)
    tx.finish()
    puller.pull_through(len(puller.entries) - 1)  # trailing aliases and empty tensors
    return SentFull(in_place, digests)
