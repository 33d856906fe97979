"""End to end: the checks that hold for any weights (``bench any-weights``, the GPU kit's stage
3) on the real SGLang 0.5.23 CPU server, with a random llama3-scaling model (sharp attention,
logits far apart: tests/harness/random_models.py) served in float32.

Here the command itself runs, starting its servers: the split view and the mask on servers with
triton attention, its kernels run by the Triton interpreter (the CPU server's torch_native
attention masks every sparse batch by position). The recompute_all, delta_zero and mask checks
on torch_native run in tests/test_recompute_models.py, on the server of the same model there.
Each check compares against the cold run or the dense reference of the same prompt, and
``paths`` includes a control that shows the comparison can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.random_models import SHAPES, build_random_model

pytestmark = pytest.mark.e2e


def _checks(
    smollm2_model_dir: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> dict[str, dict]:
    """``bench any-weights`` on the random llama3-scaling model with ``args`` (and ``env`` over
    this process's); asserts it exited 0 and returns its results by check name."""
    model = build_random_model(SHAPES["llama3_scaling"], smollm2_model_dir)
    out = tmp_path / "any-weights"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "semblend_sglang.bench", "any-weights"),
            *("--model-path", str(model), "--out", str(out), *args),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
        env=None if env is None else {**os.environ, **env},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "any-weights.json").read_text())
    return {r["name"]: r for r in report["results"]}


def test_the_split_view_and_the_mask_equal_the_dense_reference_on_an_interpreted_triton_server(
    smollm2_model_dir: Path, tmp_path: Path
) -> None:
    """The GPU path on CPU: the real server with ``--attention-backend triton`` and sglang's
    Triton kernels run by the Triton interpreter (a stand-in for their compiled CUDA form, same
    kernel source). A sparse hit after the check layer, attended as its split view and with the
    position mask, equals its dense reference. This is where the first GPU run died: the check
    layer rebuilt no metadata for the shrunk batch (sglang keeps the backend in its forward
    context), so the kernel read the full batch's offsets for the shrunk rows."""
    (paths,) = _checks(
        smollm2_model_dir,
        tmp_path,
        *("--passage-tokens", "300", "--roles", "split_view,position_mask"),
        *("--server-arg=--attention-backend", "--server-arg=triton"),
        env={"TRITON_INTERPRET": "1"},
    ).values()
    assert paths["name"] == "paths" and paths["passed"]
    detail = paths["detail"]
    for path in ("split_view", "position_mask"):
        assert detail[path]["batches_on_path"] >= 1
        assert detail[path]["gap_to_dense_reference"] <= 2e-3
    assert detail["gap_between_paths"] <= 2e-3
