"""A group's store served by a process of its own, child of rank 0 (``StatelessGroup.create(store_host=
"process")``).

Rank 0 serves the store on a thread of its process by default. That thread answers every member's every
request: its CPU grows with the group (each collective costs it about two answered requests per member), and
at a few dozen members it is most of what rank 0 spends on a repeat weight sync, a cost that is the store's,
not rank 0's share of the sync. A store served by its own process (as torchrun's agent serves the store its
workers share) leaves rank 0 its own share and can be scheduled, watched and measured on its own.

The child serves exactly the socket rank 0 bound (inherited, never rebound) and lives no longer than rank 0:
it exits when rank 0 closes its end of a pipe (``close()``, or the process ending) or when its parent
changes (rank 0 killed while another process holds a copy of the pipe, forked before). Members then see
the store go, as they do when rank 0 dies with the store on its thread. The cost: a Python process that
imports torch, about 1.5 s at the join on a 2-core machine.

"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import weakref
from datetime import timedelta
from pathlib import Path

from .errors import StoreUnreachableError
from .net import Listener

__all__ = ["StoreProcess"]

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
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)  # groupbridge importable as the parent imports it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        args = f"{fd}, {watch_r}, {ready_w}, {timeout.total_seconds()!r}"
        serve = f"from groupbridge._store_process import _serve; _serve({args})"
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", serve],
                pass_fds=(fd, watch_r, ready_w),
                stdin=subprocess.DEVNULL,
                env=env,
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
            ready, _, _ = select.select([ready_r], [], [], timeout.total_seconds())
            served = bool(ready) and os.read(ready_r, 1) == b"1"
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
        """Stop serving: the child exits once its pipe closes; killed after ``grace`` seconds. Idempotent."""
        self._close_watch()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=grace)


def _serve(fd: int, watch: int, ready: int, timeout: float) -> None:
    """The child: serve the store on ``fd`` until the pipe ``watch`` closes or the parent changes."""
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C ends rank 0, whose close ends this
    from ._torch_private import host_tcp_store

    store = host_tcp_store(fd, timedelta(seconds=timeout))
    os.write(ready, b"1")
    os.close(ready)
    while os.getppid() == parent:
        readable, _, _ = select.select([watch], [], [], _POLL_S)
        if readable and not os.read(watch, 64):
            break
    del store  # the store stops serving and its socket closes
    os._exit(0)
