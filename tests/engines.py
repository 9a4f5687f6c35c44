"""What the engine tests share: greedy tokens from ``transformers`` (the reference vLLM must match) and a
perturbation that changes them."""

from __future__ import annotations

from typing import Any

import torch

PROMPTS = [[1, 2, 3, 4], [7, 100, 5], [300, 11]]
TOKENS = 8


def reference(model: Any, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def perturb(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
