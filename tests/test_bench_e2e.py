"""The main bench job: pure pieces, and one --quick-sized run against the real CPU servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

from semblend_sglang.bench.e2e import (
    SCHEMA_VERSION,
    ProbeRecord,
    _hook_ms_delta,
    _outcome_delta,
    _parse_urls,
    console_table,
    parse_semblend_env,
    summarize,
)


def test_outcome_delta_names_the_one_outcome_a_request_added() -> None:
    before = {
        "outcomes": {"materialized": 1, "declined": 2},
        "declined": {"no_donor": 2},
        "reused_tokens": 400,
    }
    hit = dict(before, outcomes={"materialized": 2, "declined": 2}, reused_tokens=900)
    assert _outcome_delta(before, hit) == ("materialized", 500)
    miss = dict(
        before,
        outcomes={"materialized": 1, "declined": 3},
        declined={"no_donor": 2, "reuse_too_small": 1},
    )
    assert _outcome_delta(before, miss) == ("declined:reuse_too_small", 0)
    assert _outcome_delta(before, before) == ("none", 0)
    assert _outcome_delta(None, hit) == ("unknown", 0)


def test_hook_time_delta_between_snapshots() -> None:
    assert _hook_ms_delta({"hook_seconds": 0.5}, {"hook_seconds": 0.5015}) == pytest.approx(1.5)
    assert _hook_ms_delta(None, {"hook_seconds": 1.0}) is None


def test_control_rows_report_the_miss_overhead_in_the_scheduler() -> None:
    def control(system: str, kind: str, ttft: float, **kw: object) -> ProbeRecord:
        rec = _rec(system, kind, ttft, [1, 2], **kw)
        rec.workload = "control"
        return rec

    records = [
        control("vanilla", "cold", 4.0),
        control("exact_spans", "semantic", 4.4, outcome="declined:no_donor", hook_ms=2.0),
    ]
    (row,) = summarize(records)
    assert row["exact_spans_miss_overhead"] == pytest.approx(0.1)
    assert row["exact_spans_miss_hook_ms"] == pytest.approx(2.0)
    assert row["exact_spans_miss_overhead_in_scheduler"] == pytest.approx(2.0 / 4000.0)
    assert "0.050" in console_table([row])


def test_url_option_is_validated() -> None:
    assert _parse_urls(["vanilla=http://h:1", "exact_spans=http://h:2"]) == {
        "vanilla": "http://h:1",
        "exact_spans": "http://h:2",
    }
    for bad in ("http://h:1", "semantic=http://h:1", "vanilla=h:1"):
        with pytest.raises(click.BadParameter):
            _parse_urls([bad])


def test_semblend_env_option_is_validated() -> None:
    assert parse_semblend_env(["SEMBLEND_STRICT_PREFIX_BOUNDARY=0", "SEMBLEND_MAX_SPANS=4"]) == {
        "SEMBLEND_STRICT_PREFIX_BOUNDARY": "0",
        "SEMBLEND_MAX_SPANS": "4",
    }
    for bad, needle in (
        ("SEMBLEND_MODE=substitute", "other than"),
        ("SEMBLEND_NOPE=1", "SEMBLEND_\\* setting"),
        ("SEMBLEND_MAX_SPANS", "KEY=VALUE"),
        ("SEMBLEND_MAX_SPANS=lots", "SEMBLEND_MAX_SPANS"),
    ):
        with pytest.raises(click.BadParameter, match=needle):
            parse_semblend_env([bad])


def _rec(system: str, kind: str, ttft: float, ids: list[int], **kw: object) -> ProbeRecord:
    return ProbeRecord(
        "cross_instruction",
        512,
        "g0",
        0,
        system,
        kind,
        ttft,
        512,
        0,
        output_ids=ids,
        text=" ".join(map(str, ids)),
        **kw,
    )  # type: ignore[arg-type]


def test_summary_of_hand_made_records() -> None:
    records = [
        _rec("vanilla", "cold", 4.0, [1, 2, 3, 4], reference_logprobs=[-1.0, -1.0]),
        _rec("vanilla", "exact_same_length", 1.0, [1, 2, 3, 4]),
        _rec(
            "exact_spans",
            "semantic",
            1.1,
            [1, 2, 9, 9],
            outcome="materialized",
            reused_tokens=256,
            reference_logprobs=[-1.0, -2.0],
        ),
    ]
    (row,) = summarize(records)
    assert row["cold_ms_p50"] == pytest.approx(4000.0)
    assert row["exact_spans_over_exact"] == pytest.approx(1.1)
    assert row["exact_spans_hit_rate"] == 1.0
    assert row["exact_spans_reused_fraction"] == pytest.approx(0.5)
    assert row["exact_spans_ppl_ratio"] == pytest.approx(2.718281828**0.5)
    assert row["exact_spans_greedy_agreement"] == pytest.approx(2 / 32 + 28 / 32)
    assert row["exact_greedy_agreement"] == 1.0
    assert "cross_instruction" in console_table([row])


@pytest.mark.e2e
def test_quick_run_against_the_cpu_servers(tmp_path: Path, smollm2_model_dir: Path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "semblend_sglang.bench", "--quick"]
    cmd += ["--workloads", "cross_instruction", "--systems", "vanilla,exact_spans"]
    cmd += ["--model-path", str(smollm2_model_dir), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "e2e.json").read_text())
    assert (out / "e2e.png").stat().st_size > 10_000
    assert report["schema_version"] == SCHEMA_VERSION
    assert set(report) >= {"environment", "options", "summary", "records", "wall_s"}
    assert report["environment"]["versions"]["sglang"] == "0.5.23"
    assert report["options"]["lengths"] == [512]
    (row,) = report["summary"]
    assert row["workload"] == "cross_instruction" and row["context_tokens"] == 512
    assert row["exact_spans_hit_rate"] > 0  # confirmed by the server's own counters
    semantic = [r for r in report["records"] if r["kind"] == "semantic"]
    assert semantic and all(len(r["reference_logprobs"]) == 64 for r in semantic)
    assert all(0 < r["hook_ms"] < 60_000 for r in semantic)  # the server's own hook time
    assert {r["kind"] for r in report["records"]} == {
        "semantic",
        "prefix",
        "cold",
        "exact_same_length",
    }
    assert "cross_instruction" in proc.stdout
