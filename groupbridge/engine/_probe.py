"""A check that an engine serves what the trainer sent: the log-probabilities of a few tokens, computed by
each replica through its own request path, compared with the trainer's model.

Every byte of an update can arrive verified and the model served still be wrong: a loader that skips a
layer, a kernel not repacked after the reload, a tied weight left stale. Only the engine's own forward pass
shows it, so the probe asks every replica for the log-probabilities of ``tokens[1:]`` (its kernels, the
installed weights) once the swap is done, and a replica off by more than ``atol`` makes the trainer roll
every replica back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Probe", "causal_logprobs"]


@dataclass(frozen=True)
class Probe:
    """What ``TrainerConfig(verify=...)`` checks after every swap.

    Args:
        tokens: a token sequence (at least two ids); each replica scores ``tokens[1:]``.
        reference: ``reference(version)`` -> the trainer's log-probabilities of ``tokens[1:]`` at that
            version (e.g. ``lambda v: causal_logprobs(model, tokens)``: the trainer's model holds the version
            it just sent when the probe runs).
        atol: the largest difference allowed at any position. The engine's kernels are not the trainer's
            (fused, another order of sums, another dtype): bf16 engines differ by a few hundredths, fp32 by
            about 1e-5; a wrong layer moves log-probabilities by units.

    ``reference`` runs on the trainer's rank 0 alone, on a thread: a model whose forward is a collective
    (FSDP, DTensor) needs a reference that does not call it (a replica of the model, or values computed in
    the training step).
    """

    tokens: Sequence[int]
    reference: Callable[[int], Sequence[float]]
    atol: float = 0.05

    def __post_init__(self) -> None:
        toks = list(self.tokens)
        if len(toks) < 2 or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in toks):
            raise ValueError(f"tokens={self.tokens!r}: at least two token ids (ints >= 0)")
        if not callable(self.reference):
            raise TypeError("reference must be callable: reference(version) -> log-probs of tokens[1:]")
        if isinstance(self.atol, bool) or not isinstance(self.atol, (int, float)) or not self.atol > 0:
            raise ValueError(f"atol={self.atol!r} must be a positive number")
        object.__setattr__(self, "tokens", tuple(toks))

    def expected(self, version: int) -> list[float]:
        """``reference(version)``, checked to score ``tokens[1:]``."""
        want = [float(x) for x in self.reference(version)]
        if not all(math.isfinite(x) for x in want):
            raise ValueError(f"reference({version}) is not finite: {want}")
        if len(want) != len(self.tokens) - 1:
            raise ValueError(
                f"reference({version}) gave {len(want)} log-probs; the probe scores {len(self.tokens) - 1} "
                "tokens (tokens[1:])"
            )
        return want

    def worst(self, want: Sequence[float], served: Sequence[Sequence[float]]) -> tuple[int, float] | None:
        """The replica furthest from ``want`` (:meth:`expected`) and its largest difference, when beyond
        ``atol`` (a length that differs, or a value that is not finite, counts as infinitely far); None when
        all agree. Raises ValueError when no replica answered (nothing was checked)."""
        if not served:
            raise ValueError("no replica answered the probe")
        worst: tuple[int, float] | None = None
        for k, got in enumerate(served):
            got = [float(x) for x in got]
            diff = (
                max(abs(a - b) for a, b in zip(got, want, strict=True))
                if len(got) == len(want) and all(math.isfinite(a) for a in got)
                else math.inf
            )
            if diff > self.atol and (worst is None or diff > worst[1]):
                worst = (k, diff)
        return worst


def causal_logprobs(model: Any, tokens: Sequence[int]) -> list[float]:
    """A causal language model's (a ``transformers`` one: ``model(ids).logits``) log-probabilities of
    ``tokens[1:]``, in float64 from its logits: the reference a :class:`Probe` compares with."""
    device = next(model.parameters()).device
    training = model.training
    model.eval()  # dropout off: the reference must not disagree with itself
    try:
        with torch.no_grad():
            logits = model(torch.tensor([list(tokens)], device=device)).logits[0].double()
    finally:
        model.train(training)
    lp = torch.log_softmax(logits, -1)
    return [lp[i - 1, t].item() for i, t in enumerate(tokens) if i > 0]
