"""Stopping a vLLM engine so that nothing of it stays in /dev/shm.

vLLM 0.32's CPU build leaves shared memory behind when its engine stops: the tensor-parallel CPU
communicator's segments (``vllm_dist_<id>-tp:...-cpushm_<rank>``, 4 MiB each) are never unlinked, even on a
clean shutdown, and its message queues' (``psm_*``) stay when a worker is killed. Whatever stops an engine
notes the segments its processes hold just before (:func:`held_by` over :func:`process_tree`) and, once they
have exited, removes those no other process holds (:func:`remove_owned`): never a segment of another engine
started meanwhile. :func:`shutdown` and the ``vllm serve`` runner do so; :func:`remove_new` (every segment
that appeared since a snapshot) is for test harnesses that own the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "EXIT_S",
    "gone",
    "held_by",
    "process_tree",
    "remove_new",
    "remove_owned",
    "segments",
    "shutdown",
    "stop_server",
]

SHM = "/dev/shm"
PREFIXES = ("psm_", "vllm_dist_")


def segments() -> set[str]:
    """vLLM's shared-memory segments now in /dev/shm."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith(PREFIXES)}
    except FileNotFoundError:  # no /dev/shm on this host
        return set()


def _in_use() -> set[str]:
    """The segments some process (that this one may inspect) still maps or holds open."""
    return held_by(int(pid) for pid in os.listdir("/proc") if pid.isdigit())


def held_by(pids: Iterable[int]) -> set[str]:
    """The segments the processes ``pids`` map or hold open (those this process may inspect)."""
    held: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            held.update(line.split(f" {SHM}/", 1)[1].split()[0] for line in maps if f" {SHM}/" in line)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(SHM + "/"):
                        held.add(target[len(SHM) + 1 :].split()[0])
    return held


def process_tree(roots: Iterable[int]) -> set[int]:
    """``roots`` and every process descended from them."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(ValueError, IndexError):
            children.setdefault(int(_stat(int(name))[1]), []).append(int(name))
    tree, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the process's name (state, parent, ...); none when it is
    gone. The name may hold spaces and parentheses: the fields start after its last ``)``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


EXIT_S = 15.0
"""How long :func:`gone` waits by default for stopped or killed processes to exit."""


def gone(pids: Iterable[int], timeout_s: float = EXIT_S) -> list[int]:
    """Wait, at most ``timeout_s``, until none of ``pids`` runs (a zombie counts as gone: it maps nothing);
    returns those still running. A killed process keeps its mappings until it has exited: the segments it
    held are in use until then, and :func:`remove_owned` would leave them behind (seen after a server was
    killed at the end of its grace: every segment stayed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [pid for pid in pids if _stat(pid)[:1] not in ([], ["Z"], ["X"])]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def remove_owned(owned: set[str]) -> list[str]:
    """Remove the vLLM segments of ``owned`` (what an engine's processes held before they stopped) that
    still exist and that no process maps or holds open; returns them. Call it once those processes are
    gone."""
    removed = []
    for name in sorted((owned & segments()) - _in_use()):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM, name))
            removed.append(name)
    return removed


def remove_new(before: set[str]) -> list[str]:
    """Remove the vLLM segments that appeared since ``before`` and that no process still maps or holds
    open; returns them. For a harness that started every engine on the machine since ``before`` (another
    engine's segment not yet mapped would go too): an engine's own stop uses :func:`remove_owned`."""
    return remove_owned(segments() - before)


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """Stop a server started in its own session (``start_new_session=True``): SIGTERM to the server alone,
    which stops its engine and workers in order (a signal to the whole group kills the workers first); the
    group is killed only when the server has not exited within ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):  # then killed below
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def shutdown(llm: Any, *, timeout: timedelta = timedelta(seconds=60)) -> None:
    """Stop an offline ``vllm.LLM``'s engine now: its processes exit in order, not whenever the object is
    collected (vLLM then force-kills the engine process at interpreter exit). Call it after the trainer
    engine's ``shutdown()``, which has vLLM's workers leave the bridge first. Then the shared memory its
    processes held and left behind is removed (vLLM 0.32 never unlinks its CPU communicator's segments); a
    segment another process still holds stays. Calling it again does nothing.

    Args:
        llm: the offline engine.
        timeout: how long its processes may take to exit before vLLM kills them. vLLM's own default, 5 s, is
            shorter than its engine takes to stop its worker on a busy 2-core host (measured: 5-6 s).

    Raises:
        TypeError: ``llm`` is not an offline ``vllm.LLM`` (a server is stopped by whoever started it).
    """
    import vllm

    from ._compat import engine_client, engine_pids

    if not isinstance(llm, vllm.LLM):
        raise TypeError(f"shutdown() takes an offline vllm.LLM, got {type(llm).__name__}")
    pids = engine_pids(llm)
    tree = process_tree(pids)
    owned = held_by(tree)  # the engine's and its workers' segments, before they exit
    done = threading.Event()
    nudger = threading.Thread(target=_nudge, args=(pids, done), name="groupbridge-vllm-stop", daemon=True)
    nudger.start()
    try:
        engine_client(llm).shutdown(timeout=timeout.total_seconds())
    finally:
        done.set()
        nudger.join(1.0)
    gone(tree)
    remove_owned(owned)


NUDGE_AFTER_S = 10.0
"""How long an engine process may keep vLLM's SIGTERM handler armed after being told to stop, before the
signal is sent again to its main thread (see :func:`_nudge`)."""


def _nudge(pids: Sequence[int], done: threading.Event, after: float = NUDGE_AFTER_S) -> None:
    """Re-send SIGTERM to the main thread of an engine process that did not act on vLLM's.

    An idle engine process waits on its input queue in its main thread; Python runs signal handlers only
    there. A SIGTERM the kernel hands to another of its threads sets Python's flag but wakes nothing, and
    vLLM's handler runs only when the queue gets a message: seen once in CI, where the engine did not react
    for 60 s and vLLM killed it and its worker. A signal aimed at the main thread interrupts the wait.

    Sent only while the process still catches SIGTERM: once vLLM's handler has run, vLLM restores the
    default action for its teardown, and a second SIGTERM would kill it midway.
    """
    while not done.wait(after):
        for pid in pids:
            if _catches(pid, signal.SIGTERM):
                logger.warning(
                    "groupbridge: vLLM's engine process %d has not acted on SIGTERM after %.0f s; sending it "
                    "again, to its main thread", pid, after,
                )  # fmt: skip
                _signal_thread(pid, pid, signal.SIGTERM)


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` is alive and has a handler installed for ``sig`` (its SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                    return False
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def _signal_thread(pid: int, tid: int, sig: int) -> None:
    """``sig`` to thread ``tid`` of process ``pid`` (glibc's tgkill), else to the process."""
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None or tgkill(pid, tid, int(sig)) != 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
