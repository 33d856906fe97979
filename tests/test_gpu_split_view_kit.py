"""The split-view GPU check's kit (scripts/gpu_split_view_kit.sh), built and imported on a CPU.

scripts/gpu_split_view.py runs on a GPU host without sglang or this package, from the folder the
kit lays out. Here the kit is built into a temporary folder and the script is loaded from there
in a subprocess (its module body only: the check itself needs CUDA): every module it imports
must come from the kit, not from this venv, and the copied modules must work together (the
split view's sequences and the Triton metadata of a random batch). A module that gains an
import the kit does not carry fails here instead of on the GPU host.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
KIT_SCRIPT = REPO_ROOT / "scripts" / "gpu_split_view_kit.sh"
CHECK_SCRIPT = REPO_ROOT / "scripts" / "gpu_split_view.py"

LOAD_FROM_THE_KIT = f"""
import json, runpy, sys
ns = runpy.run_path({str(CHECK_SCRIPT)!r}, run_name="kit_check")
from tests.sparse_extend_batches import random_batch
from semblend_sglang.kernels.sparse_extend_triton import build_sparse_extend_metadata
from semblend_sglang.patches.sglang.attention.split_view import split_sequences
batch = random_batch(0, n_requests=4)
metadata = build_sparse_extend_metadata(batch.rows())
sequences = split_sequences(ns["fb_of"](batch))
names = ("sglang", "sglang.srt.utils", "sglang.srt.environ",
         "sglang.kernels.ops.attention.extend_attention", "semblend_sglang",
         "semblend_sglang.kernels.sparse_extend", "semblend_sglang.kernels.sparse_extend_triton",
         "semblend_sglang.patches.sglang.attention.split_view",
         "semblend_sglang.patches.sglang.batch_fields",
         "tests.sparse_extend_batches")
print(json.dumps({{
    "files": {{name: sys.modules[name].__file__ for name in names}},
    "kv_indptr_end": int(metadata.kv_indptr[-1]),
    "sequences": None if sequences is None else len(sequences.request),
    "requests": int(batch.seq_lens.numel()),
}}))
"""


def test_the_split_view_check_loads_every_module_from_its_kit(tmp_path: Path) -> None:
    kit = tmp_path / ".gpu"
    subprocess.run(["bash", str(KIT_SCRIPT), str(kit)], check=True, capture_output=True)
    done = subprocess.run(
        [sys.executable, "-c", LOAD_FROM_THE_KIT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    site = (kit / "site").resolve()
    outside = {
        name: path
        for name, path in report["files"].items()
        if not Path(path).resolve().is_relative_to(site)
    }
    assert outside == {}, f"imported from outside the kit: {outside}"
    assert report["kv_indptr_end"] > 0
    assert report["sequences"] is None or report["sequences"] >= report["requests"]
