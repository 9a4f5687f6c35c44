"""Background threads for gloo work no caller waits for, and the exit hook that waits for them.

The registry is process-wide, not per group, on purpose: these threads outlive the group that started them
(a teardown releases its process groups on one and returns; the group may be gone before the thread ends),
and what they guard against is the process exiting, which is one event for all groups. One set and one
:mod:`atexit` hook, registered when the first such thread starts (importing has no side effect), cover every
group of the process.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_GRACE_S", "background"]

_BACKGROUND: set[threading.Thread] = set()
_BACKGROUND_LOCK = threading.Lock()
_HOOKED = False
EXIT_GRACE_S = 10.0
"""How long interpreter exit waits for gloo work left running in the background (see :func:`background`)."""


def background(fn: Callable[[], None], name: str) -> threading.Thread:
    """Run ``fn`` (gloo connect or teardown, which can block for seconds on a vanished peer) on a daemon
    thread the caller need not wait for. Interpreter exit waits for such threads (up to ``EXIT_GRACE_S``):
    a process exiting while gloo's C++ teardown runs aborts with "terminate called without an active
    exception" instead of exiting with its own status."""

    def run() -> None:
        try:
            fn()
        finally:
            with _BACKGROUND_LOCK:
                _BACKGROUND.discard(threading.current_thread())

    global _HOOKED
    thread = threading.Thread(target=run, name=name, daemon=True)
    with _BACKGROUND_LOCK:
        if not _HOOKED:
            atexit.register(_await_background)
            _HOOKED = True
        _BACKGROUND.add(thread)
    thread.start()
    return thread


def _await_background() -> None:
    end = time.monotonic() + EXIT_GRACE_S
    with _BACKGROUND_LOCK:
        pending = list(_BACKGROUND)
    for thread in pending:
        thread.join(max(0.0, end - time.monotonic()))
