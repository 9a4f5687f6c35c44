"""The suite's watchdog (tests/conftest.py) ends a run whose test outlives its timeout and its grace."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from groupbridge.vllm._stop import gone

HUNG = """
import subprocess, time
from pathlib import Path

import pytest

@pytest.mark.timeout(1)
def test_hangs_in_its_cleanup():
    child = subprocess.Popen(["sleep", "120"])
    Path("child").write_text(str(child.pid))
    try:
        time.sleep(60)
    finally:
        time.sleep(60)  # pytest-timeout's alarm fired once already: only the watchdog ends this

def test_never_reached():
    pass
"""


def test_a_test_hung_in_its_cleanup_ends_the_run_with_its_stack_its_children_killed(tmp_path: Path) -> None:
    (tmp_path / "test_hung.py").write_text(textwrap.dedent(HUNG))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-o", "watchdog_grace=2",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "test_hung.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert took < 30, took
    out = run.stdout + run.stderr
    said = "watchdog: test_hung.py::test_hangs_in_its_cleanup still runs 3 s after it began"
    assert said in out, out[-3000:]
    assert "time.sleep(60)  # pytest-timeout" in out  # the main thread's stack, at the wait that hung
    assert "test_never_reached" not in out
    child = int((tmp_path / "child").read_text())
    assert gone([child], timeout_s=10) == [], "the hung test's child process outlived the run"
