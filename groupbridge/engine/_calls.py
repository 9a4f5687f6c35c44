"""An engine's calls beside a sync: each on a thread of its own (the trainer sends while the engine's RPC
waits for the bytes), with an abort of the bridge armed when one fails."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import GroupBridgeError, WeightSyncError
from ..stateless import StatelessGroup

__all__ = ["Call", "abort_later", "usable"]


def usable(group: StatelessGroup) -> bool:
    try:
        group.check_open()
    except GroupBridgeError:
        return False
    return True


def abort_later(group: StatelessGroup, error: BaseException, grace: float) -> Callable[[], None]:
    """Abort ``group`` unless the sync ends on its own within ``grace`` seconds (a worker's refusal reaches
    the sender through the bridge too, and must not be turned into an abort). Returns a canceller."""
    cancelled = threading.Event()

    def run() -> None:
        if not cancelled.wait(grace):
            group.abort(f"the engine's side of the update failed: {type(error).__name__}: {error}")

    threading.Thread(target=run, name="groupbridge-engine-abort", daemon=True).start()
    return cancelled.set


class Call:
    """``fn`` on a daemon thread, so the trainer can send while the engine's call waits for the bytes."""

    def __init__(
        self,
        what: str,
        fn: Callable[[], None],
        on_error: Callable[[BaseException], Callable[[], None]] | None = None,
    ) -> None:
        self.what = what
        self.error: BaseException | None = None
        self._cancel: Callable[[], None] | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        self._on_error = on_error

        def run() -> None:
            try:
                fn()
            except BaseException as e:
                self.error = e
                with self._lock:  # after cancel_abort(), a late failure arms nothing (a retry is not aborted)
                    if self._on_error is not None and not self._cancelled:
                        self._cancel = self._on_error(e)

        self._thread = threading.Thread(target=run, name=f"groupbridge-engine-{what}", daemon=True)
        self._thread.start()

    def join(self, seconds: float) -> None:
        self._thread.join(seconds)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def cancel_abort(self) -> None:
        """Disarm the abort this call's failure armed, or would arm if it failed later."""
        with self._lock:
            self._cancelled = True
            if self._cancel is not None:
                self._cancel()

    def result(self) -> None:
        if self._thread.is_alive():
            raise WeightSyncError(
                f"the engine's {self.what} did not return within the bound; the call is still running in the "
                "engine, which may yet complete it"
            )
        if self.error is not None:
            raise WeightSyncError(
                f"the engine's {self.what} failed: {type(self.error).__name__}: {self.error}"
            ) from self.error
