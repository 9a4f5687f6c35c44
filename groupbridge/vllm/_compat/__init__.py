"""Where groupbridge reaches into vLLM past its public API (the weight-transfer engine's base classes and
factory, ``LLM``, ``LoRARequest``), kept in one place: read and tested against the vLLM releases of
:data:`._gate.TESTED`, which the backend holds to (:func:`check_version`).

- :mod:`._core`: the commit and its version label in one engine-core call; the engine core's admission of
  requests (a prompt token outside the vocabulary, an adapter version no worker can load); what each worker
  holds after a failed commit.
- :mod:`._model`: vLLM's layerwise reload, the shadow copy of the model and its exchange with the serving
  copy, the CPU kernel set-up vLLM skips after a reload.
- :mod:`._dryrun`: a manifest checked through the model's own ``load_weights`` on meta tensors.
- :mod:`._adapters`: adapters served from memory through vLLM's LoRA loader; an adapter's fit to the model.

- :mod:`._probe`: a probe's request on an offline engine, added and read apart from users' requests.
- :mod:`._procs`: an offline engine's engine-core processes (to stop them).
- :mod:`._gate`: the version gate, and :data:`~._gate.PRIVATE`, every private name read, each through
  :func:`private` (a name that is gone fails by name, never defaults).

``tests/test_vllm_compat.py`` resolves every listed name on the installed vLLM without starting an engine;
the tests that start real engines (``tests/test_vllm.py``, ``tests/test_serve.py``) check what they do.
"""

from ._adapters import check_adapter, loaded_adapters, serve_adapters
from ._core import ATTACH, COMMIT, PAUSED, TORN, commit_offline, install
from ._dryrun import check_loadable
from ._gate import PRIVATE, TESTED, check_version, module_of, private
from ._model import (
    begin_reload,
    build_shadow,
    checkpoint_gone,
    cpu_kernel_handles,
    end_reload,
    exchange,
    on_cpu,
    rank_in_world,
    refresh_cpu_kernels,
    same_layout,
)
from ._probe import own_request
from ._procs import engine_client, engine_pids

__all__ = [
    "ATTACH",
    "COMMIT",
    "PAUSED",
    "PRIVATE",
    "TESTED",
    "TORN",
    "begin_reload",
    "build_shadow",
    "check_adapter",
    "check_loadable",
    "check_version",
    "checkpoint_gone",
    "commit_offline",
    "cpu_kernel_handles",
    "end_reload",
    "engine_client",
    "engine_pids",
    "exchange",
    "install",
    "loaded_adapters",
    "module_of",
    "on_cpu",
    "own_request",
    "private",
    "rank_in_world",
    "refresh_cpu_kernels",
    "same_layout",
    "serve_adapters",
]
