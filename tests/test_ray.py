"""Ray actor groups as torch worlds and bridges, on a local Ray instance the test starts itself."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install 'groupbridge[ray]')"
)


@pytest.mark.slow  # 24 s (a Ray instance of its own); make test stays under its bound
@pytest.mark.timeout(180)
def test_ray_one_step_off_policy_example() -> None:
    root = Path(__file__).parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run(
            [sys.executable, str(root / "examples" / "ray_one_step_off_policy.py"), "--steps", "3"],
            capture_output=True, text=True, env=env, timeout=170, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:  # show where it stood
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"the example ran past 170 s; stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "trainer world cpu:gloo x2" in out and "bridge 'weights' at 127.0.0.1:" in out
    assert out.count("verified: yes") == 3 and "all syncs verified" in out


def test_start_world_rejects_non_members() -> None:
    from groupbridge import ray as gb_ray

    with pytest.raises(TypeError, match=r"must subclass groupbridge\.ray\.WorldMember"):
        gb_ray.start_world(object, 2)
