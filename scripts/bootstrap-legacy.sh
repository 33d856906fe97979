#!/usr/bin/env bash
# Creates or updates .venv-legacy: the second environment `make test-legacy` runs tests/legacy in,
# with a legacy sglang (0.5.15, RadixCache) instead of the main environment's 0.5.23.
#
#   scripts/bootstrap-legacy.sh [VENV_DIR]      (default: .venv-legacy next to the Makefile)
#
# Same recipe as scripts/bootstrap.sh, on a CPU-only Linux x86_64 machine:
# 1. torch==2.13.0 through requirements/constraints.txt (an unpinned torch pulls GBs of CUDA);
# 2. requirements/pinned.txt, with the pins of requirements/legacy-pins.txt replacing its own
#    (transformers 5.12.1 for sglang 0.5.15), under the same constraint;
# 3. requirements/legacy-no-deps.txt with --no-deps (sglang==0.5.15 and the offline wheels);
# 4. the project itself, editable, with --no-deps.
# Idempotent: a stamp holds the hash of every input; with nothing changed it exits in seconds.
# The main .venv and its stamp (scripts/bootstrap.sh) are not touched.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-legacy}"
python="${PYTHON:-python3}"
stamp="$venv/.semblend-bootstrap-legacy"

inputs_hash() {
  cat "$repo/requirements/constraints.txt" "$repo/requirements/pinned.txt" \
      "$repo/requirements/legacy-pins.txt" "$repo/requirements/legacy-no-deps.txt" \
      "$repo/pyproject.toml" "$repo/scripts/bootstrap-legacy.sh" \
    | sha256sum | cut -d' ' -f1
}

want="$(inputs_hash)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "bootstrap-legacy: $venv is up to date; nothing to install"
  exit 0
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "bootstrap-legacy: $python is $("$python" --version 2>&1); Python >= 3.10 is required" >&2
  exit 1
fi

echo "bootstrap-legacy: installing into $venv (first run: ~3 GB, several minutes)"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraint=(-c "$repo/requirements/constraints.txt")

# pinned.txt without the packages legacy-pins.txt pins, then legacy-pins.txt.
merged="$(mktemp)"
trap 'rm -f "$merged"' EXIT
"$venv/bin/python" - "$repo/requirements/pinned.txt" "$repo/requirements/legacy-pins.txt" \
  > "$merged" <<'PY'
import re, sys

def name(line):
    line = line.split("#", 1)[0].strip()
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
    return re.sub(r"[-_.]+", "-", m.group(0)).lower() if m else None

pinned, overrides = (open(p).read().splitlines() for p in sys.argv[1:3])
replaced = {name(l) for l in overrides} - {None}
for line in pinned:
    if name(line) not in replaced:
        print(line)
print("\n".join(overrides))
PY

"${pip[@]}" install -q "${constraint[@]}" torch==2.13.0
"${pip[@]}" install -q "${constraint[@]}" -r "$merged"
"${pip[@]}" install -q --no-deps -r "$repo/requirements/legacy-no-deps.txt"
"${pip[@]}" install -q --no-deps --no-build-isolation -e "$repo"

# The torch that ended up installed must still be the CPU build we pinned, and sglang the
# legacy one.
"$venv/bin/python" - "$repo/requirements/legacy-no-deps.txt" <<'PY'
import re
import sys
from importlib.metadata import version

import torch

if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"bootstrap-legacy: expected torch 2.13.0, found {torch.__version__}")
pin = re.search(r"^sglang==(\S+)", open(sys.argv[1]).read(), re.M)
if pin is None or version("sglang") != pin.group(1):
    sys.exit(f"bootstrap-legacy: expected sglang {pin and pin.group(1)}, found {version('sglang')}")
PY

echo "$want" > "$stamp"
echo "bootstrap-legacy: done ($venv)"
