"""TRL's asynchronous GRPO trainer sending its weights to ``vllm serve`` through groupbridge.

TRL's ``AsyncGRPOTrainer`` takes a weight-transfer object; ``groupbridge.trl.WeightTransfer`` is one, for a
server started with backend ``"groupbridge"``::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "groupbridge"}'

    trainer = AsyncGRPOTrainer(model=MODEL, ..., weight_transfer=WeightTransfer("http://host:8000"))

TRL then calls ``init_weight_transfer`` at train begin, ``pause`` / ``send_weights`` / ``resume`` every
sync, ``destroy`` at the end. The server keeps generating while the bytes land; it is paused (``"keep"``:
requests in flight are frozen, not dropped) only for the swap.

This script runs on any machine: it starts a local ``vllm serve`` on a small random Qwen2 and makes TRL's
calls in TRL's order, three syncs, printing what the server serves after each. (TRL's trainer itself needs
CUDA for its attention kernel; on a GPU host pass the object to ``AsyncGRPOTrainer`` instead.)

    python examples/trl_async_grpo.py
"""

from __future__ import annotations

import tempfile

import torch

from groupbridge.trl import WeightTransfer
from groupbridge.vllm import Server
from groupbridge.vllm.models import make_model


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        policy = make_model(f"{tmp}/model", "qwen2")  # your policy in real use
        print("starting vllm serve (about 30 s) ...")
        with Server(f"{tmp}/model", log=f"{tmp}/serve.log") as server:
            transfer = WeightTransfer(server.base, timeout_s=120)  # host=, token=, delta=True, ... as needed
            transfer.init_weight_transfer()  # TRL: at train begin
            try:
                for step in range(1, 4):
                    with torch.no_grad():  # a training step
                        for p in policy.parameters():
                            p.add_(torch.randn_like(p) * 0.02)
                    transfer.pause()  # TRL: before each sync (here: asks for a pause at the swap only)
                    transfer.send_weights(iter((n, p.detach()) for n, p in policy.named_parameters()))
                    transfer.resume()
                    s = transfer.last_seconds
                    print(f"step {step}: the server serves version {server.weight_version()} "
                          f"(transfer {s['transfer']:.2f} s, swap {s['commit']:.2f} s); "
                          f"it says {server.complete([1, 2, 3], 6)}")  # fmt: skip
            finally:
                transfer.destroy()  # TRL: at train end


if __name__ == "__main__":
    main()
