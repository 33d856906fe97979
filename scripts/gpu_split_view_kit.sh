#!/usr/bin/env bash
# Builds .gpu/ (git-ignored; or the folder named by $1, which tests/test_gpu_split_view_kit.py
# uses) for scripts/gpu_split_view.py on a GPU machine without sglang: sglang 0.5.23's Triton
# extend kernel files verbatim from .venv, two import shims, and copies of the torch-only modules
# the check imports. Carry .gpu with the device run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
kit=${1:-.gpu}
if [ "$kit" = .gpu ]; then
    grep -qx "/.gpu/" .git/info/exclude || echo "/.gpu/" >> .git/info/exclude
fi
src=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])")
rm -rf "$kit"
mkdir -p "$kit/site/sglang/kernels/ops/attention" "$kit/site/sglang/srt"
for f in extend_attention.py decode_attention.py score_mod.py; do
    cp "$src/kernels/ops/attention/$f" "$kit/site/sglang/kernels/ops/attention/"
done
for d in sglang sglang/kernels sglang/kernels/ops sglang/kernels/ops/attention sglang/srt; do
    touch "$kit/site/$d/__init__.py"
done
cat > "$kit/site/sglang/srt/environ.py" <<'PY'
"""Import shim for the GPU check only: every sglang env flag reads as unset (off)."""


class _Flag:
    def get(self):
        return False


class _Envs:
    def __getattr__(self, name):
        return _Flag()


envs = _Envs()
PY
cat > "$kit/site/sglang/srt/utils.py" <<'PY'
"""Import shim for the GPU check only: the platform probes the kernel files read."""
import torch


def is_cuda():
    return torch.cuda.is_available() and torch.version.cuda is not None


def is_hip():
    return False


def is_gfx95_supported():
    return False


def is_gfx1250_supported():
    return False


def get_device_core_count(device_id=0):
    return torch.cuda.get_device_properties(device_id).multi_processor_count
PY
# This repository's torch-only modules, at their package paths (empty __init__ files: the real
# ones import sglang); the check imports them as semblend_sglang.* and tests.*.
pkg=$kit/site/semblend_sglang
mkdir -p "$pkg/kernels" "$pkg/patches/sglang/attention" "$kit/site/tests"
for d in "$pkg" "$pkg/kernels" "$pkg/patches" "$pkg/patches/sglang" "$pkg/patches/sglang/attention" \
    "$kit/site/tests"; do
    touch "$d/__init__.py"
done
cp kernels/sparse_extend.py kernels/sparse_extend_triton.py "$pkg/kernels/"
cp patches/sglang/batch_fields.py "$pkg/patches/sglang/"
cp patches/sglang/attention/split_view.py "$pkg/patches/sglang/attention/"
cp tests/sparse_extend_batches.py "$kit/site/tests/"
echo "built $kit ($(du -sh "$kit" | cut -f1))"
