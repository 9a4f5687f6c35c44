"""Transports move a sync's buckets; all plug in behind WeightSender / WeightReceiver.

- ``broadcast``: the group's own broadcast (gloo on CPU, NCCL & co. on devices).
- ``relay``: a chunked, pipelined chain over the group's send/recv, so each link carries the bytes once.
- ``shm``: a ring of shared-memory segments on one host; the sender fills, receivers copy out in parallel.
- ``cuda_ipc``: the same over CUDA IPC buffers, for CUDA tensors on one host.

The sender chooses (``auto``: same host -> shm or cuda_ipc; else broadcast up to two receivers, relay
beyond) and announces the choice in the sync's header; receivers follow.
"""

from __future__ import annotations

from .base import Land, RxTransport, TxTransport, choose, make_rx, make_tx

__all__ = ["Land", "RxTransport", "TxTransport", "choose", "make_rx", "make_tx"]
