from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import groupbridge as gb
from tests.helpers import CTX, run_ranks, share_port

LAUNCHER_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DIST_INIT_METHOD"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [*LAUNCHER_VARS, "TORCHELASTIC_USE_AGENT_STORE"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _clear_launcher_env() -> None:
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)


@pytest.mark.timeout(90)
def test_torchrun_three_ranks_no_backend_named(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # torchrun binds its own rendezvous port: no fixed port here
        "--nproc-per-node",
        "3",
        str(Path(__file__).parent / "_torchrun_world.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=80, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    expected_backend = gb.split_backend()
    for r, s in enumerate(seen):
        device = "cpu" if expected_backend == "cpu:gloo" else f"{gb.accelerator()}:{r}"
        assert s["group"] == [r, r, 3, expected_backend, device]
        assert s["sum"] == 6.0
        assert s["obj"] == {"from": 0, "payload": [1, 2, 3]}
        assert s["idempotent"] is True


def _spawned_world(rank: int, world_size: int, ports: Any) -> dict[str, Any]:
    _clear_launcher_env()
    lis, port = share_port(rank, world_size, ports, "127.0.0.1")
    if lis is not None:
        g = gb.init_global_group(rank=0, world_size=world_size, listener=lis, timeout=timedelta(seconds=30))
    else:
        g = gb.init_global_group(
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=30),
        )
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    out = {"g": (g.rank, g.world_size, g.backend), "sum": t.tolist()}
    gb.destroy_global_group()
    return out


@pytest.mark.timeout(60)
def test_spawned_three_ranks_explicit_arguments() -> None:
    ports = CTX.Queue()
    results = run_ranks(_spawned_world, 3, 3, ports, timeout=50)
    for r, res in enumerate(results):
        assert res["g"] == (r, 3, gb.split_backend())
        assert res["sum"] == [3.0] * 4


def _world_of_one(rank: int) -> dict[str, Any]:
    _clear_launcher_env()
    g = gb.init_global_group()
    t = torch.ones(3)
    dist.all_reduce(t)
    again = gb.init_global_group()
    same_backend = gb.init_global_group(backend=gb.split_backend())
    errors = []
    for kwargs in ({"world_size": 2, "rank": 0}, {"backend": "mpi"} if dist.is_mpi_available() else None):
        if kwargs is None:
            continue
        try:
            gb.init_global_group(**kwargs)  # type: ignore[arg-type]
        except ValueError as e:
            errors.append(str(e))
    gb.destroy_global_group()
    gb.destroy_global_group()
    second = gb.init_global_group()
    gb.destroy_global_group()
    return {
        "g": (g.rank, g.local_rank, g.world_size, g.backend, g.device),
        "sum": t.tolist(),
        "idempotent": again == g == same_backend,
        "errors": errors,
        "second": (second.rank, second.world_size),
    }


@pytest.mark.timeout(60)
def test_world_of_one_under_plain_python() -> None:
    (res,) = run_ranks(_world_of_one, 1, timeout=50)
    assert res["g"][:3] == (0, 0, 1)
    assert res["g"][3] == gb.split_backend()
    assert res["sum"] == [1.0, 1.0, 1.0]
    assert res["idempotent"] is True
    assert (
        len(res["errors"]) == 1 and "world_size=1" in res["errors"][0] and "world_size=2" in res["errors"][0]
    )
    assert res["second"] == (0, 1)


BAD_ENV = [
    ({"RANK": "3", "WORLD_SIZE": "3"}, {}, "RANK=3 must be < WORLD_SIZE=3"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, {}, "RANK='-1' must be >= 0"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, {}, "RANK='one' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2.5"}, {}, "WORLD_SIZE='2.5' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, {}, "WORLD_SIZE='0' must be >= 1"),
    ({"LOCAL_RANK": "0"}, {}, "LOCAL_RANK=0 is set but RANK is not"),
    ({"RANK": "0"}, {}, "RANK=0 is set but WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, {}, "MASTER_PORT='70000' is outside 1-65535"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "0"}, {}, "MASTER_PORT='0' is outside 1-65535"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "x"}, {}, "MASTER_PORT='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, {}, "MASTER_PORT is not set"),
    ({"LOCAL_RANK": "-2", "RANK": "0", "WORLD_SIZE": "1"}, {}, "LOCAL_RANK='-2' must be >= 0"),
    ({}, {"rank": 3, "world_size": 3}, "rank=3 must be < world_size=3"),
    ({}, {"rank": -1, "world_size": 3}, "rank=-1 must be >= 0"),
    ({}, {"rank": 0, "world_size": 0}, "world_size=0 must be >= 1"),
    ({}, {"rank": 1}, "rank=1 is set but world_size is not"),
    ({}, {"world_size": 2}, "world_size=2 is set but rank is not"),
    ({}, {"rank": 0, "world_size": 2}, "world_size=2 needs a rendezvous"),
    ({}, {"backend": "cpu:gloo,cpu:gloo"}, "names device 'cpu' twice"),
    ({}, {"backend": "warp"}, "backend='warp' is not a known backend"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, {"rank": 5}, "rank=5 must be < world_size=2"),
]


@pytest.mark.parametrize(("env", "kwargs", "message"), BAD_ENV)
def test_bad_input(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], kwargs: dict[str, Any], message: str
) -> None:
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(ValueError) as info:
        gb.init_global_group(**kwargs)
    assert message in str(info.value)
    assert not dist.is_initialized()


@pytest.mark.skipif(dist.is_nccl_available(), reason="this build has NCCL")
def test_backend_this_build_lacks(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError) as info:
        gb.init_global_group(backend="cpu:gloo,cuda:nccl")
    msg = str(info.value)
    assert "nccl" in msg and "lacks" in msg and "gloo" in msg
    assert not dist.is_initialized()


def test_timeout_must_be_timedelta(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError):
        gb.init_global_group(timeout=30)  # type: ignore[arg-type]


def test_destroy_is_idempotent(clean_env: pytest.MonkeyPatch) -> None:
    gb.destroy_global_group()  # nothing to destroy: no error
    assert not dist.is_initialized()
    g = gb.init_global_group()
    assert dist.is_initialized() and g.world_size == 1
    gb.destroy_global_group()
    assert not dist.is_initialized()
    gb.destroy_global_group()
    assert not dist.is_initialized()
