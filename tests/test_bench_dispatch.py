"""``bench dispatch`` (bench/dispatch_simulation.py): the simulation runs, is
deterministic in its hit rates, and donor-aware dispatch keeps hits that load-only dispatch
loses."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from semblend_sglang.bench.dispatch_simulation import build_workload, command, run


def test_workload_is_deterministic_and_shares_content_within_groups() -> None:
    a, b = build_workload(200, seed=3), build_workload(200, seed=3)
    assert [r.units for r in a.requests] == [r.units for r in b.requests]
    assert len(a.requests) == 200 and {r.kind for r in a.requests} >= {"rag", "multi_turn"}


def test_donor_aware_dispatch_keeps_the_hits_load_only_dispatch_loses() -> None:
    results = {(r.method, r.ranks): r for r in run(400, (4,), seed=1)}
    single = results[("single", 4)].hit_rate
    assert results[("donor+tt", 4)].hit_rate >= 0.9 * single
    assert results[("round_robin", 4)].hit_rate <= 0.6 * single
    again = {(r.method, r.ranks): r.hit_rate for r in run(400, (4,), seed=1)}
    assert again == {k: r.hit_rate for k, r in results.items()}


def test_command_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    res = CliRunner().invoke(command, ["--requests", "150", "--ranks", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["results"]} >= {"single", "round_robin", "donor+rr"}
