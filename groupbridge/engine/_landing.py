"""An update's bytes landing on a thread of their own, while the engine serves (see :class:`Landing`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch

from ..errors import WeightSyncError
from ..stateless import StatelessGroup
from ..weights.receiver import WeightUpdate

__all__ = ["Landing", "keep_then"]

Pairs = Iterator[tuple[str, torch.Tensor]]

_END = object()


def keep_then(update: WeightUpdate, keep: Callable[[], None] | None) -> WeightUpdate:
    """Run ``keep`` (the rollback copy) before ``update`` overwrites the kept buffer; if it fails, the sync
    is aborted for every member (nothing was read yet) and the failure raised."""
    if keep is not None:
        try:
            keep()
        except BaseException:
            update.close()
            raise
    return update


class Landing:
    """An update's bytes landing on a thread of their own, in the kept buffer: an atomic update's while the
    engine goes on serving (``update`` may be the call that opens it, the handshake: the engine serves
    through that too); a streaming update's ahead of the loader, which takes each tensor as it lands
    (``pairs()``), so that the transfer and the load overlap instead of taking turns. Views of the kept
    buffer stay valid until the next update, so landing ahead overwrites nothing the loader holds."""

    def __init__(
        self,
        update: WeightUpdate | Callable[[], WeightUpdate],
        log: logging.Logger,
        *,
        version: int | None = None,
        stream: bool = False,
        before: Callable[[], None] | None = None,
        into: list[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        self.version = update.version if isinstance(update, WeightUpdate) else version
        self.staged: list[tuple[str, torch.Tensor]] | None = None
        self.landed: list[tuple[str, torch.Tensor]] = into if into is not None else []
        """The pairs landed so far (``into``, where given: all of them once the update's iteration ends,
        what the receiver's ``ready`` reads before the sender is acknowledged)."""
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._queue: queue.SimpleQueue[object] | None = queue.SimpleQueue() if stream else None
        self._stop = threading.Event()
        self._stuck_at: float | None = None

        def run() -> None:
            t0 = time.perf_counter()
            landed = self.landed
            try:
                opened = update if isinstance(update, WeightUpdate) else update()
                self.version = opened.version
                pairs = iter(keep_then(opened, before))
                for item in pairs:
                    if self._stop.is_set():  # the loader failed: the sync is abandoned, the sender told
                        pairs.close()  # type: ignore[attr-defined]
                        break
                    landed.append(item)
                    if self._queue is not None:
                        self._queue.put(item)
                else:
                    self.staged = landed
            except BaseException as e:  # the sender was told by the receiver; the engine learns at commit
                self.error = e
                log.error("groupbridge: version %d did not land (%s: %s); the model is untouched (a landing "
                          "fills only the kept buffer)", self.version, type(e).__name__, e)  # fmt: skip
            finally:
                self.seconds = time.perf_counter() - t0
                if self._queue is not None:
                    self._queue.put(_END)

        self._thread = threading.Thread(target=run, name=f"groupbridge-landing-{self.version}", daemon=True)
        self._thread.start()

    def pairs(self, seconds: float) -> Pairs:
        """The landed pairs as they land (``stream``); raises what stopped the landing. ``seconds`` bounds
        the wait for each (the landing's own waits are bounded by the update's timeout)."""
        assert self._queue is not None
        while True:
            try:
                item = self._queue.get(timeout=seconds)
            except queue.Empty:
                raise TimeoutError(
                    f"no tensor of version {self.version} landed within {seconds:g} s"
                ) from None
            if item is _END:
                if self.error is not None:
                    raise self.error
                return
            yield item  # type: ignore[misc]

    def feed(
        self, load: Callable[[Pairs], None], group: StatelessGroup | None, *, timeout: float, liveness: float
    ) -> None:
        """A streaming update: ``load`` takes the pairs as they land (each waited for within ``timeout``);
        then the landing is stopped and waited for, within the ``liveness`` bound (the group aborted if it
        must be)."""
        try:
            load(self.pairs(timeout))
        finally:
            self.stop()
            if not self.wait(liveness + 5) and group is not None:
                group.abort(f"the landing of version {self.version} did not stop")
                self.wait(liveness + 5)

    def halt(self, group: StatelessGroup | None, liveness: float, why: str, *, settle: bool) -> None:
        """Stop a landing still running: the group is aborted (its waits end within the ``liveness``
        bound), then the thread waited for, bounded. Raises WeightSyncError when it still runs: the session
        cannot receive on this bridge (two threads would write the same buffer).

        ``settle`` (a new update begins): the landing first gets the liveness bound to end on its own. The
        trainer begins an update only once the last one returned on its side, and a landing whose sender
        already returned may still be taking its last message (its thread outlives the acknowledgement the
        sender waited for): aborting it then broke the new update (seen in CI, after a failed commit)."""
        if settle and self.running:
            self.wait(liveness)
        if self.running and group is not None:
            group.abort(why)
        bound = liveness + 5
        if not self.wait(bound):
            self._stuck_at = time.monotonic() - bound
            raise WeightSyncError(
                f"this worker's landing of version {self.version} is stuck: it did not stop within {bound:g} "
                f"s of its bridge being aborted (aborted as {why}); this worker takes no update until it "
                "ends: restart the engine's workers if it does not"
            )

    def stuck_for(self) -> float:
        """Seconds since this landing's bridge was aborted without it stopping (0 if it stopped)."""
        return time.monotonic() - self._stuck_at if self._stuck_at is not None else 0.0

    def stop(self) -> None:
        self._stop.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, seconds: float) -> bool:
        self._thread.join(seconds)
        return not self._thread.is_alive()
