"""Stopping a vLLM engine so that nothing of it stays in /dev/shm.

vLLM 0.32's CPU build leaves shared memory behind when its engine stops: the tensor-parallel CPU
communicator's segments (``vllm_dist_<id>-tp:...-cpushm_<rank>``, 4 MiB each) are never unlinked, even on a
clean shutdown, and its message queues' (``psm_*``) stay when a worker is killed. Whatever starts an engine
notes the segments before (:func:`segments`) and, once every process of the engine has exited, removes the
ones that appeared since (:func:`remove_new`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from datetime import timedelta
from typing import Any

__all__ = ["remove_new", "segments", "shutdown", "stop_server"]

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
    held: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            held.update(line.rsplit("/", 1)[-1].strip() for line in maps if f" {SHM}/" in line)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(SHM + "/"):
                        held.add(target.rsplit("/", 1)[-1])
    return held


def remove_new(before: set[str]) -> list[str]:
    """Remove the vLLM segments that appeared since ``before`` and that no process still maps or holds
    open (another engine's stay); returns them. Call it once the engine's processes are gone."""
    removed = []
    held = _in_use()
    for name in sorted(segments() - before - held):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM, name))
            removed.append(name)
    return removed


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
    engine's ``shutdown()``, which has vLLM's workers leave the bridge first. Calling it again does nothing.

    Args:
        llm: the offline engine.
        timeout: how long its processes may take to exit before vLLM kills them. vLLM's own default, 5 s, is
            shorter than its engine takes to stop its worker on a busy 2-core host (measured: 5-6 s).

    Raises:
        TypeError: ``llm`` is not an offline ``vllm.LLM`` (a server is stopped by whoever started it).
    """
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    stop = getattr(engine_core, "shutdown", None)
    if not callable(stop):
        raise TypeError(f"shutdown() takes an offline vllm.LLM, got {type(llm).__name__}")
    stop(timeout=timeout.total_seconds())
