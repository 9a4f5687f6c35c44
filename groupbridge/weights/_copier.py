"""A thread the library owns for the bulk copies of a weight sync, running with one intra-op thread.

On small machines torch's idle intra-op (OpenMP) workers spin after a multi-threaded copy and starve the
transport's threads (measured: up to 2x slower on 2 cores). The setting is per thread: here it leaves the
caller's own work (an engine's ``load_weights``) alone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from ..control import Deadline
from ..errors import CopyTimeoutError

T = TypeVar("T")


class Job(Generic[T]):
    """A callable queued on the copy thread, collected within the sync's deadline."""

    def __init__(self, thread: str, deadline: Deadline | None) -> None:
        self.out: list[Any] = []
        self.done = threading.Event()
        self._thread = thread
        self._deadline = deadline

    def result(self) -> T:
        deadline = self._deadline
        if not self.done.wait(None if deadline is None else max(0.0, deadline.left())):
            raise CopyTimeoutError(
                f"a copy on thread {self._thread} did not finish within the sync's {deadline} (the copy "
                "thread is stuck or the machine is overloaded)"
            )
        ok, value = self.out[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]


class Copier:
    """Runs callables on one library-owned thread (one intra-op thread); :meth:`close` joins it."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._name = name
        self.deadline: Deadline | None = None
        """The running sync's deadline: a job not done by then raises :class:`CopyTimeoutError`."""

    def _run(self) -> None:
        torch.set_num_threads(1)  # this thread only
        while (job := self._jobs.get()) is not None:
            fn, out, done = job
            try:
                out.append((True, fn()))
            except BaseException as e:  # handed back to the caller, which raises it
                out.append((False, e))
            finally:
                done.set()
            # the last job's callable must not outlive it here: it may hold a sync's tensors until the next
            del job, fn, out, done

    def run(self, fn: Callable[[], T]) -> T:
        return self.submit(fn).result()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on this thread (a transport's bulk copy: see ``transports.base.Sync.copy``)."""
        self.run(lambda: dst.copy_(src))

    def submit(self, fn: Callable[[], T]) -> Job[T]:
        """Queue ``fn``; the caller works on meanwhile and collects it with ``result()``."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"groupbridge-copy-{self._name}", daemon=True
            )
            self._thread.start()
        job: Job[T] = Job(f"groupbridge-copy-{self._name}", self.deadline)
        self._jobs.put((fn, job.out, job.done))
        return job

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=10)
            self._thread = None
