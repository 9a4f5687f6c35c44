"""The bytes of the version a worker served before the one it is receiving, so that it can load them again.

A worker's received bytes land in one kept buffer, reused every update: while version N+1 lands there,
version N's bytes are overwritten, and the model (packed, fused, on the engine's own layout) cannot give
them back. A worker that may have to roll back (a probe that disagreed, a replica of the fleet whose swap
failed) copies N's bytes aside just before N+1 starts landing: one more copy of the model's wire bytes in
host memory, and one memcpy of them per update, made on the landing thread while the engine serves.
"""

from __future__ import annotations

import torch

__all__ = ["KeptCopy"]

Pairs = list[tuple[str, torch.Tensor]]


class KeptCopy:
    """Where the bytes of the versions a worker can load again are.

    ``served``: views of the kept buffer holding the version just committed (valid until the next landing
    begins). ``copy``: the rollback buffer, holding the version served before the next landing began.
    """

    def __init__(self) -> None:
        self.served: tuple[int, Pairs] | None = None
        self.copy: tuple[int, Pairs] | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    def committed(self, version: int, views: Pairs | None) -> None:
        """``version`` is now served, its bytes in ``views`` (None: not kept, e.g. a stream not kept)."""
        self.served = (version, views) if views is not None else None

    def before_landing(self) -> None:
        """A new update is about to land in the kept buffer: copy the served version's bytes aside (into
        buffers reused across updates while names, shapes and dtypes stay)."""
        if self.served is None:
            return
        version, views = self.served
        self.served = None
        fresh: dict[str, torch.Tensor] = {}
        for name, t in views:
            buf = self._buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                # host memory, whatever the kept buffer's device (a GPU engine keeps no second copy there);
                # pinned where an accelerator loads it back
                pinned = t.device.type != "cpu" and torch.cuda.is_available()
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
            buf.copy_(t)
            fresh[name] = buf
        self._buffers = fresh
        self.copy = (version, list(fresh.items()))

    def rolled_back(self) -> None:
        """The copy is what the model serves again: nothing to copy before the next landing."""
        self.served = None

    def clear(self) -> None:
        self.served, self.copy = None, None
        self._buffers = {}
