"""groupbridge as TRL's weight transfer: ``AsyncGRPOTrainer(weight_transfer=gb.trl.WeightTransfer(url))``.

TRL's asynchronous trainers take any object with ``init_weight_transfer``, ``pause``, ``send_weights``,
``resume`` and ``destroy`` (its ``WeightTransferProtocol``), called on the main process only. This one drives
a ``vllm serve`` started with ``--weight-transfer-config '{"backend": "groupbridge"}'`` (and
``VLLM_SERVER_DEV_MODE=1``, for its weight-sync routes) over HTTP, and sends over a groupbridge bridge: IPv6
or host names, bounded waits, a manifest checked by vLLM's own loader before any byte moves, checksums, a
shared token, atomic updates, deltas, and shared memory when the server is on the trainer's host.

Where TRL's own transfer pauses the server for the whole transfer, here the bytes land while vLLM serves:
``pause()`` only asks that the server be paused (``mode``, default ``"keep"``: requests in flight are frozen,
not dropped) just before the swap, vLLM's load of the staged update; TRL's ``resume()`` lets them go on, on
the new weights. TRL needs no change and vLLM is not imported in the trainer: only the server runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .engine import Described, SessionState, TrainerConfig, TrainerSession
from .vllm._control import HttpClient, VllmControl

__all__ = ["WeightTransfer"]


class WeightTransfer(SessionState):
    """TRL's weight-transfer object over backend ``"groupbridge"`` of a vLLM server.

    Args:
        base_url: the vLLM server (``http://host:port``).
        pause: the server's pause mode at the swap (``"keep"``, ``"wait"``, ``"abort"``), or None to never
            pause it (requests in flight then go on through the swap: a sequence may mix tokens of both
            versions).
        http_timeout: seconds that bound each HTTP call (the update's own bound is ``timeout_s``).
        **config: :class:`groupbridge.engine.TrainerConfig`'s fields (``host`` the trainer binds and the
            server's workers dial, ``workers`` = the server's worker processes, ``transport``, ``token``,
            ``atomic``, ``delta``, ``timeout_s``, ...).
    """

    def __init__(
        self, base_url: str, *, pause: str | None = "keep", http_timeout: float = 300.0, **config: Any
    ) -> None:
        if pause not in (None, "keep", "wait", "abort"):
            raise ValueError(f"pause={pause!r} must be 'keep', 'wait', 'abort' or None")
        self.config = TrainerConfig(**{"name": "trl", **config})
        if self.config.verify is not None and pause is not None:
            raise ValueError(
                "verify probes the server after the swap, while TRL keeps it paused until resume(): the "
                "probe would wait out its bound; pass pause=None to verify"
            )
        self.client = HttpClient(base_url, timeout=http_timeout)
        self._pause = pause
        self._paused = False
        self._asked = False
        self._described = Described()
        self.session: TrainerSession | None = None

    def __bool__(self) -> bool:  # TRL tests the object's truth before every call but the first
        return True

    def init_weight_transfer(self) -> None:
        """Host the bridge and have the server's workers join it (TRL: once, at train begin)."""
        self.session = TrainerSession(self.config, VllmControl(self.client, before_commit=self._at_swap))
        self.session.connect()

    def pause(self) -> None:
        """Ask for the server to be paused at the swap (not now: the bytes land while it serves). A
        streaming update (``atomic=False``) swaps layer by layer as bytes arrive: the server is paused now."""
        self._asked = True
        if not self.config.atomic:
            self._at_swap()

    def _at_swap(self) -> None:
        if self._asked and self._pause is not None and not self._paused:
            self.client.pause(self._pause)
            self._paused = True

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Send the trainer's (name, tensor) pairs as the next version; returns once the server serves it."""
        if self.session is None:
            raise RuntimeError("init_weight_transfer() has not been called")
        pairs, specs = self._described.pairs(iterator)
        try:
            self.session.send(pairs, specs=specs)
        except Exception:
            self._described.forget()  # a changed model is described again
            raise
        self._described.sent(pairs)

    def resume(self) -> None:
        """Resume the server if it was paused at the swap."""
        self._asked = False
        if self._paused:
            self._paused = False
            self.client.resume()

    def destroy(self) -> None:
        """Have the server's workers leave and close the bridge (TRL: at train end, failed or not)."""
        try:
            if self._paused:
                self.resume()
        finally:
            if self.session is not None:
                self.session.close()
                self.session = None
