"""Tensor-parallel ranks agree on what a prefill batch reused (patches/sglang/rank_agreement.py).

Two real processes in a real gloo group (tests/tp_rank_worker.py), each running the sglang 0.5.23
cache harness with semblend patched, as two TP ranks' schedulers do: both build the same batches.
Rank 1 alone suffers a fault (the K/V copy out of memory, a failed lookup, an unreadable RoPE
config); without agreement it would compute positions rank 0 copied and the ranks would run
extends of different sizes into the same collectives (a hang in a real TP forward). The test
requires the same extend sizes on both ranks, the request finished on both, every harness
invariant, and the outcome each rank counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from semblend_sglang.server import free_port

WORKER = Path(__file__).resolve().parent / "tp_rank_worker.py"
SCENARIOS = ["healthy", "kernel_oom", "lookup_error", "rope_unreadable"]


def _run_ranks(tmp_path: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(rank),
                "2",
                str(port),
                str(spec_file),
                str(tmp_path / f"rank{rank}.json"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:  # a hang: the ranks disagreed on a collective
            for p in procs:
                p.kill()
            raise AssertionError("a rank did not finish within 300 s (hung collective?)") from None
        logs.append(out)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{logs[rank][-4000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_agree_on_reuse_when_one_rank_fails(
    tmp_path: Path,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    doc = [t for p in passages[2][:8] for t in p]
    spec = {
        "model_dir": str(model_config.model_path),
        "donor": instructions[0] + doc,
        "target": instructions[5] + doc,
        "scenarios": SCENARIOS,
    }
    rank0, rank1 = _run_ranks(tmp_path, spec)
    target_len = len(spec["target"])
    for name in SCENARIOS:
        a, b = rank0[name], rank1[name]
        # the same extend sizes into the forward on both ranks
        assert a["donor_extends"] == b["donor_extends"], (name, a, b)
        assert a["target_extends"] == b["target_extends"], (name, a, b)
        assert a["finished"] and b["finished"], name
        assert a["invariants"] == "ok" and b["invariants"] == "ok", (name, a, b)
        computed = sum(a["target_extends"])
        if name == "healthy":
            assert computed < target_len // 2, a  # the document was reused on both
            assert a["outcomes"]["materialized"] == b["outcomes"]["materialized"] == 1
            continue
        assert computed == target_len, (name, a)  # every position computed on both
        assert a["outcomes"].get("materialized", 0) == 0, (name, a)
        assert a["declined"].get("rank_disagreement") == 1, (name, a)
    assert rank1["kernel_oom"]["errors"] == {"load": 1}
    assert rank1["kernel_oom"]["outcomes"]["cold_fallback"] == 1
    assert rank1["lookup_error"]["outcomes"]["cold_fallback"] == 2  # donor and target lookups
    assert rank1["rope_unreadable"]["declined"].get("unsupported_cache") == 1
