"""Imported at start by every process of a ``vllm serve`` that a test starts with this folder first on
``PYTHONPATH`` (see ``tests/test_vllm.py``): with ``GROUPBRIDGE_TEST_TEAR=N`` set, each worker's N-th load
into its model fails midway, after three tensors, leaving the model torn, as a loader that raises would.
Only the tests set it; groupbridge never reads it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

TARGET = "groupbridge.vllm._worker"


def _arm(module: Any, fail_at: int) -> None:
    original = module.VllmLoader.load
    count = [0]

    def load(self: Any, weights: Any) -> None:
        count[0] += 1
        if count[0] == fail_at:
            first = [next(weights) for _ in range(3)]

            def midway() -> Any:
                yield from first
                raise RuntimeError("injected: the loader failed midway")

            weights = midway()
        original(self, weights)

    module.VllmLoader.load = load


class _Finder(importlib.abc.MetaPathFinder):
    """Arms the loader right after ``groupbridge.vllm._worker`` is first imported."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.loader is not None
        execute, fail_at = spec.loader.exec_module, self.fail_at

        def exec_module(module: Any) -> None:
            execute(module)
            _arm(module, fail_at)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("GROUPBRIDGE_TEST_TEAR"):
    sys.meta_path.insert(0, _Finder(int(os.environ["GROUPBRIDGE_TEST_TEAR"])))
