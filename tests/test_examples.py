"""The README's vLLM quickstart as pasted, and the engine examples (vLLM, TRL, verl), run as a user runs them:
a fresh interpreter each, bounded, every process they start reaped, nothing left in /dev/shm.

Heavy (each starts a real engine or server): in ``make test-slow``, which CI runs after ``make test``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from groupbridge.vllm._stop import remove_new, segments

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).parent.parent


def survivors(marker: str) -> list[int]:
    """The processes whose environment carries ``marker``: what a script started (its server, its engine's
    processes, in whatever session) and left running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if marker.encode() in f.read():
                found.append(int(pid))
    return found


def run(argv: list[str], cwd: Path, seconds: float, returncode: int = 0) -> str:
    """Run a script in its own session; past ``seconds`` it is interrupted (its own clean-up runs), then
    its session killed, and the test fails with the end of its output. After it, no process it started
    may be left, nor anything in /dev/shm. Returns stdout and stderr together."""
    run_id = uuid.uuid4().hex
    marker = f"GROUPBRIDGE_TEST_RUN={run_id}"  # as it reads in /proc/<pid>/environ
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "INFO"}
    env["GROUPBRIDGE_TEST_RUN"] = run_id
    before = segments()
    proc = subprocess.Popen(
        [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        # SIGINT first: the script's own clean-up runs (a server it started lives in a session of its own)
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        pytest.fail(f"{argv[0]} ran past {seconds:g} s:\n{out[-4000:]}")
    finally:  # what it left is noted first, then cleaned up, whatever happened
        left = [pid for pid in survivors(marker) if pid != os.getpid()]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        leaked = segments() - before
        remove_new(before)
    assert proc.returncode == returncode, f"{argv[0]} exited {proc.returncode}:\n{out[-4000:]}"
    assert not left, f"{argv[0]} left processes {left} running:\n{out[-3000:]}"
    assert "force killing" not in out, f"{argv[0]} left vLLM's engine to be killed at exit:\n{out[-3000:]}"
    assert not leaked, f"{argv[0]} left shared memory behind: {sorted(leaked)}"
    return out


def readme_block(heading: str) -> str:
    """The first Python block under ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"no Python block under {heading!r}"
    return match.group(1)


def test_the_readme_vllm_quickstart_runs_as_pasted(tmp_path: Path) -> None:
    code = readme_block("## With vLLM")
    assert "/tmp/qwen2-tiny" in code  # where the block builds its model: here, a folder of this test's
    code = code.replace("/tmp/qwen2-tiny", str(tmp_path / "qwen2-tiny"))
    (tmp_path / "quickstart.py").write_text(code)
    out = run([str(tmp_path / "quickstart.py")], tmp_path, 180)
    assert re.search(r"^1$", out, re.M), out[-3000:]  # the version vLLM serves after the first update


def test_the_readme_trl_quickstart_runs_as_pasted(tmp_path: Path) -> None:
    code = readme_block("## With TRL")
    assert "/tmp/qwen2-tiny" in code
    code = code.replace("/tmp/qwen2-tiny", str(tmp_path / "qwen2-tiny"))
    (tmp_path / "quickstart.py").write_text(code)
    out = run([str(tmp_path / "quickstart.py")], tmp_path, 180)
    assert re.search(r"^1$", out, re.M), out[-3000:]  # the version the server serves after TRL's first sync


def test_the_vllm_example_runs(tmp_path: Path) -> None:
    out = run([str(ROOT / "examples" / "vllm_one_step_off_policy.py"), "--steps", "2"], tmp_path, 180)
    assert re.search(r"^\s+2\s+2\s", out, re.M), out[-3000:]  # step 2 served version 2


def test_the_trl_example_runs(tmp_path: Path) -> None:
    out = run([str(ROOT / "examples" / "trl_async_grpo.py")], tmp_path, 180)
    assert "the server serves version 3" in out, out[-3000:]


def test_the_verl_example_runs(tmp_path: Path) -> None:
    out = run([str(ROOT / "examples" / "verl_checkpoint_engine.py")], tmp_path, 120)
    assert out.count("equal to the actor's") == 3, out[-3000:]
    assert out.count("(delta, ") == 2 and "(full, " in out, out[-3000:]  # updates 2 and 3 are deltas


# The demo with two faults: the trainer's reference tokens changed at step 3 (an engine serving other
# weights than the trainer's reads the same to the check), and the engines' generation of batch 4 raising
# (during step 4, while rank 1 already waits in its sync). Steps 1 and 2 must pass the real check, step 3
# fail it, and step 4 end the demo: the bridge closed, rank 1 ended, the engines stopped.
DEMO_WITH_FAULTS = """
import sys
from groupbridge import cli, demo_vllm

real_reference, real_generate, calls = demo_vllm._reference, demo_vllm._generate, []

def reference(model):
    calls.append(1)
    tokens = real_reference(model)
    return tokens if len(calls) < 3 else [[t + 1 for t in row] for row in tokens]

def generate(llm, prompts, seed):
    if seed >= 8:  # batch 4 (seeds 2 * step + engine)
        raise RuntimeError("injected: the engine failed generating batch 4")
    return real_generate(llm, prompts, seed)

demo_vllm._reference, demo_vllm._generate = reference, generate
sys.exit(cli.main(["demo", "--steps", "5", "--host", "127.0.0.1"]))
"""


@pytest.mark.timeout(420)
def test_the_demo_runs_through_two_vllm_engines_and_stops_on_a_bad_check_or_a_fault(tmp_path: Path) -> None:
    """``make demo``'s loop: two trainer ranks, two vLLM engines as one fleet; every step both engines report
    the version sent and serve the trainer's weights (greedy tokens and log-probabilities); the step whose
    check fails is marked; a fault ends the demo with exit code 1 and nothing left running or in
    /dev/shm."""
    out = run(["-c", DEMO_WITH_FAULTS], tmp_path, 400, returncode=1)
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+[1-5] +\d+/\d+ ", line)]
    got = [(r[0], r[1], r[-1]) for r in rows]
    assert got == [("1", "1/1", "yes"), ("2", "2/2", "yes"), ("3", "3/3", "NO")], out[-3000:]
    # one step off-policy, as data: step t updates version t-1 from the batch vLLM's spans say version t-2
    # made (generated while step t-1 learned; 0: the weights the engines started with)
    assert [r[2] for r in rows] == ["0", "0", "1"], out[-3000:]
    # the served log-probabilities agree with the trainer's all along, and a version behind would not
    assert all(float(r[-3]) < 1e-3 < float(r[-2]) for r in rows), out[-3000:]
    assert "injected: the engine failed generating batch 4" in out, out[-3000:]
