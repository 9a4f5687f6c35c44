"""A group's store served by a process of its own, child of rank 0 (``StatelessGroup.create(store_host=
"process")``).

Rank 0 serves the store on a thread of its process by default. That thread answers every member's every
request: its CPU grows with the group (each collective costs it about two answered requests per member), and
at a few dozen members it is most of what rank 0 spends on a repeat weight sync, a cost that is the store's,
not rank 0's share of the sync. A store served by its own process (as torchrun's agent serves the store its
workers share) leaves rank 0 its own share and can be scheduled, watched and measured on its own.

The child serves exactly the socket rank 0 bound (inherited, never rebound) and lives no longer than rank 0:
it exits when rank 0 closes its end of a pipe (``close()``, or the process ending), when rank 0 stops it
(``close()`` also sends SIGTERM: a process forked from rank 0 may hold a copy of the pipe), or when its
parent is no longer rank 0 (rank 0 killed while such a copy lives). Members then see the store go, as they
do when rank 0 dies with the store on its thread. It reads the same ``sys.path`` as rank 0, so it imports
the groupbridge and torch rank 0 runs. The cost: a Python process that imports torch, about 1.5 s at the
join on a 2-core machine.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import weakref
from datetime import timedelta

from .errors import StoreUnreachableError
from .net import Listener

__all__ = ["StoreProcess"]

logger = logging.getLogger(__name__)

_POLL_S = 0.1
"""How often the child looks whether rank 0 is still its parent."""


class StoreProcess:
    """A child process serving rank 0's store on its listener (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], watch: int) -> None:
        self.proc = proc
        # the write end of the pipe the child watches: closing it stops the child. Closed exactly once, by
        # stop() or, for a group dropped unclosed, when this object is collected
        self._close_watch = weakref.finalize(self, os.close, watch)

    @classmethod
    def start(cls, listener: Listener, timeout: timedelta) -> StoreProcess:
        """Serve a store on ``listener``'s socket from a child process; returns once it serves. The
        listener is closed here either way (the child holds its own copy of the socket).

        Raises:
            StoreUnreachableError: the child did not start serving within ``timeout`` (its output says why).
        """
        watch_r, watch_w = os.pipe()
        ready_r, ready_w = os.pipe()
        fd = listener.fileno()
        args = f"{fd}, {watch_r}, {ready_w}, {timeout.total_seconds()!r}, {os.getpid()}"
        serve = (  # a Ctrl-C ends rank 0, whose close ends this; groupbridge found where rank 0 found it
            "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            f"sys.path[:] = {sys.path!r}; "
            f"from groupbridge._store_process import _serve; _serve({args})"
        )
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", serve], pass_fds=(fd, watch_r, ready_w), stdin=subprocess.DEVNULL
            )
        except BaseException:
            for end in (watch_r, watch_w, ready_r, ready_w):
                os.close(end)
            raise
        finally:
            listener.close()
        os.close(watch_r)
        os.close(ready_w)
        self = cls(proc, watch_w)
        try:
            served = _read_ready(ready_r, timeout.total_seconds())
        except BaseException:  # an interrupt while it starts: it goes too
            self.stop(grace=1.0)
            raise
        finally:
            os.close(ready_r)
        if not served:
            self.stop(grace=1.0)
            raise StoreUnreachableError(
                f"the store's process (pid {proc.pid}) did not start serving on {listener.address} within "
                f"{timeout.total_seconds():g}s (exit status {proc.returncode}; its output above says why)"
            )
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop serving now and reap the child (killed if it outlives ``grace`` seconds). Idempotent. The
        pipe's close would end it alone, unless a process forked from rank 0 holds a copy of its end: the
        child is told with SIGTERM too."""
        self._close_watch()
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("the store's process (pid %d) outlived SIGKILL by %gs", self.proc.pid, grace)


def _read_ready(fd: int, timeout: float) -> bool:
    """Whether the child wrote that it serves within ``timeout`` seconds (poll: any descriptor number)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000)) and os.read(fd, 1) == b"1"


def _serve(fd: int, watch: int, ready: int, timeout: float, parent: int) -> None:
    """The child: serve the store on ``fd`` until the pipe ``watch`` closes or rank 0 (``parent``) is gone."""
    from ._torch_private import host_tcp_store

    if os.getppid() != parent:  # rank 0 died while this process started
        os._exit(0)
    store = host_tcp_store(fd, timedelta(seconds=timeout))
    os.write(ready, b"1")
    os.close(ready)
    poller = select.poll()
    poller.register(watch, select.POLLIN)
    while os.getppid() == parent:
        if poller.poll(_POLL_S * 1000) and not os.read(watch, 64):
            break  # rank 0 closed its end
    del store  # the store stops serving and its socket closes
    os._exit(0)
