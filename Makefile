# semblend-sglang — every target creates/updates .venv first (scripts/bootstrap.sh, idempotent).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export SEMBLEND_MODEL_CACHE ?= $(CURDIR)/.cache/models
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
PYTEST_ARGS ?=

.PHONY: venv test lint bench serve prepare-model clean

venv:
	@scripts/bootstrap.sh $(VENV)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

prepare-model: venv
	$(VENV)/bin/semblend-sglang prepare-model

bench: venv
	$(PY) -m semblend_sglang.bench --quick

serve: venv
	$(VENV)/bin/semblend-sglang serve

clean:
	rm -rf $(VENV) .cache build dist *.egg-info .pytest_cache .ruff_cache
