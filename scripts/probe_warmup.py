"""What warming the probe's scoring path when the trainer starts buys: the first verified update's
unverified window (requests served between the swap and the probe's verdict), with the warm-up and without.

Each variant on a vLLM engine of its own (a fresh engine's first scoring request pays its warm-up), three
verified updates of a small Qwen2 built locally. Usage::

    .venv/bin/python scripts/probe_warmup.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(warm: bool) -> None:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from groupbridge.engine import Probe, causal_logprobs
    from groupbridge.engine._trainer import TrainerSession
    from groupbridge.vllm import OfflineClient, TrainerInitInfo
    from groupbridge.vllm.models import make_model
    from tests.engines import perturb
    from tests.test_vllm import PROBE, engine

    path = Path(tempfile.mkdtemp())
    model = make_model(path, "qwen2", seed=3)
    llm = engine(path)
    if not warm:
        TrainerSession._warm = lambda self, probe: None  # type: ignore[method-assign]
    probe = Probe(PROBE, lambda v: causal_logprobs(model, PROBE), atol=1e-3)
    info = TrainerInitInfo(rank=0, timeout_s=60, liveness_s=10, verify=probe)
    eng = WeightTransferTrainerFactory.trainer_init(
        info, client=OfflineClient(llm), source=ModuleSource(model)
    )
    windows = []
    for step in range(3):
        perturb(model, step)
        eng.send_weights()
        windows.append(f"{eng.session.last_seconds['unverified']:.3f}")
    warmed = eng.session.warm_seconds
    print(f"RESULT {'warmed at start' if warm else 'not warmed':16} warm-up {warmed or 0:.3f} s, unverified "
          f"window per update (s): {', '.join(windows)}", flush=True)  # fmt: skip
    eng.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1] == "warm")
    else:
        for mode in ("warm", "cold"):
            out = subprocess.run(
                [sys.executable, __file__, mode], capture_output=True, text=True, timeout=600
            )
            print("\n".join(line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")))
