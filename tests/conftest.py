"""The suite's backstop for a test that its timeout cannot end.

pytest-timeout (``timeout`` in pyproject.toml, ``@pytest.mark.timeout``) raises inside the test when its time
is up, so that the test's ``finally`` blocks and fixtures still stop what it started. Its alarm fires once: a
wait in that cleanup, or one that never returns to Python, would then hold the run until CI's own limit, with
nothing said of where. This watchdog gives each test its timeout plus a grace (:data:`GRACE_S`); past that it
prints every thread's stack, kills the processes the run started and ends the run (exit status 1): one failed
run that says where it hung, not a silent hour.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import pytest

from groupbridge.vllm._stop import process_tree  # no vLLM import: /proc only

GRACE_S = 180.0
"""Past its timeout, how long a test may take to clean up (an engine's shutdown is bounded at 60 s); the ini
option ``watchdog_grace`` sets another."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("watchdog_grace", "seconds a test may run past its timeout before the run ends",
                  default=str(GRACE_S))  # fmt: skip


def _timeout(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    else:
        value = item.config.getini("timeout")
    return float(value) if value not in (None, "") and float(value) > 0 else None


def _end_run(item: pytest.Item, limit: float, grace: float) -> None:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    try:
        if capman is not None:
            capman.suspend_global_capture(in_=True)
        out = sys.__stderr__ or sys.stderr
        out.write(
            f"\n\nwatchdog: {item.nodeid} still runs {limit:.0f} s after it began, {grace:.0f} s past its "
            "timeout (a wait its timeout could not end, or its cleanup after it): every thread's stack "
            "follows; the processes this run started are killed and the run ends\n"
        )
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            out.write(f"\n--- thread {names.get(ident, '?')} ({ident}) ---\n")
            out.write("".join(traceback.format_stack(frame)))
        out.flush()
    finally:
        for pid in process_tree([os.getpid()]) - {os.getpid()}:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    timeout = _timeout(item)
    if timeout is None:
        yield
        return
    grace = float(item.config.getini("watchdog_grace"))
    limit = timeout + grace
    timer = threading.Timer(limit, _end_run, (item, limit, grace))
    timer.name, timer.daemon = "groupbridge-test-watchdog", True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
