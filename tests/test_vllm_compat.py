"""The vLLM compat layer without an engine: every private vLLM name it lists resolves on the installed vLLM,
the backend refuses a vLLM outside the tested releases (unless opted in), and a private name that is gone
fails by name."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import pytest

import groupbridge as gb

pytest.importorskip("vllm")

from groupbridge.vllm import _compat
from groupbridge.vllm._compat import _gate


def _assigned(cls: type, name: str) -> bool:
    """Whether some class of ``cls``'s MRO assigns ``self.<name>`` in its source (an instance attribute)."""
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=")
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


@pytest.mark.parametrize("entry", _gate.PRIVATE, ids=lambda p: f"{p.owner or p.module}.{p.name}")
def test_every_private_vllm_name_listed_is_there(entry: Any) -> None:
    module = importlib.import_module(entry.module)
    owner = getattr(module, entry.owner) if entry.owner else module
    found = hasattr(owner, entry.name) or (inspect.isclass(owner) and _assigned(owner, entry.name))
    where = f"{entry.owner or entry.module}.{entry.name}"
    assert found, f"vLLM {_gate.installed()}: {where} is gone ({entry.why})"
    assert entry.why and entry.instead


def test_no_private_vllm_name_is_read_outside_compat_or_with_a_default() -> None:
    """The names of PRIVATE are read in groupbridge/vllm/_compat/ alone, never as getattr(..., default)."""
    import pathlib

    root = pathlib.Path(gb.__file__).parent / "vllm"
    private = {p.name for p in _gate.PRIVATE if p.name.startswith("_") and p.name != "__init__"}
    for path in root.rglob("*.py"):
        text = path.read_text()
        for name in private:
            defaulted = re.search(rf"getattr\([^()]*(\([^()]*\))?[^()]*,\s*[\"']{name}[\"']\s*,", text)
            assert defaulted is None, f"{path}: {name} read with a default: {defaulted.group(0)}"
            if "_compat" not in path.parts:
                assert not re.search(rf"[.\"']{name}\b", text), f"{path} reads {name} outside _compat"


def test_supported_releases() -> None:
    assert _gate.supported("0.32.0") and _gate.supported("0.32.4.dev12+gabc") and _gate.supported("0.32.1rc1")
    assert not _gate.supported("0.33.0") and not _gate.supported("0.31.9") and not _gate.supported("main")
    assert _gate.supported(_gate.installed()), "the installed vLLM is the one the tests run: it is tested"


def test_a_vllm_outside_the_tested_releases_is_refused_by_name_unless_opted_in(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    from groupbridge.vllm import TrainerEngine, TrainerInitInfo

    monkeypatch.delenv(_gate.OPT_IN, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    with pytest.raises(gb.VLLMCompatError) as e:
        TrainerEngine(client=object(), info=TrainerInitInfo(rank=1))  # type: ignore[arg-type]
    assert "0.40.1" in str(e.value) and ">=0.32, <0.33" in str(e.value) and _gate.OPT_IN in str(e.value)

    installs = []
    monkeypatch.setattr(_compat, "install", lambda: installs.append(1))
    from groupbridge.vllm._plugin import register

    register()
    assert installs == [], "the plugin changed vLLM on a release it was not tested against"

    monkeypatch.setenv(_gate.OPT_IN, "1")
    with caplog.at_level("WARNING", logger="vllm.groupbridge"):
        engine = TrainerEngine(client=object(), info=TrainerInitInfo(rank=1))  # type: ignore[arg-type]
    assert engine.session is None  # rank 1 of one source: built, nothing to send
    assert any("0.40.1" in r.getMessage() for r in caplog.records), caplog.records
    register()
    assert installs == [1]


def test_a_private_name_that_is_gone_fails_by_name() -> None:
    class Core:
        pass

    with pytest.raises(gb.VLLMCompatError, match=r"Core\._weight_version.*is gone"):
        _gate.private(Core(), "_weight_version")


def test_the_docs_list_every_private_name_read() -> None:
    import pathlib

    docs = (pathlib.Path(__file__).parent.parent / "docs" / "vllm.md").read_text()
    for p in _gate.PRIVATE:
        where = f"`{p.module}.{p.owner + '.' if p.owner else ''}{p.name}`"
        assert where in docs, f"docs/vllm.md does not list {where}"
