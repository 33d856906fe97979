"""The main bench job: pure pieces, and one --quick-sized run against the real CPU servers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from semblend_sglang.bench.e2e import SCHEMA_VERSION
from semblend_sglang.bench.e2e_runner import ProbeRecord, requests_per_group
from semblend_sglang.bench.e2e_summary import summarize
from semblend_sglang.bench.e2e_table import markdown_table
from semblend_sglang.bench.report import console_table
from semblend_sglang.bench.snapshot_deltas import ms_delta, outcome_delta
from semblend_sglang.bench.systems import (
    DEFAULT_SYSTEMS,
    SERVER_ENV,
    SGLANG_DISPATCH,
    SYSTEMS,
    ServerPlan,
    parse_semblend_env,
    parse_urls,
    plan_servers,
)
from semblend_sglang.bench.workloads import BenchRequest, RequestGroup
from semblend_sglang.config import Config
from semblend_sglang.server import SglangServer, cpu_dp_environ, dp_size_of


def test_outcome_delta_names_the_one_outcome_a_request_added() -> None:
    before = {
        "outcomes": {"materialized": 1, "declined": 2},
        "declined": {"no_donor": 2},
        "reused_tokens": 400,
    }
    hit = dict(before, outcomes={"materialized": 2, "declined": 2}, reused_tokens=900)
    assert outcome_delta(before, hit) == ("materialized", 500)
    miss = dict(
        before,
        outcomes={"materialized": 1, "declined": 3},
        declined={"no_donor": 2, "reuse_too_small": 1},
    )
    assert outcome_delta(before, miss) == ("declined:reuse_too_small", 0)
    assert outcome_delta(before, before) == ("none", 0)
    assert outcome_delta(None, hit) == ("unknown", 0)


def test_hook_time_delta_between_snapshots() -> None:
    hook = ({"hook_seconds": 0.5}, {"hook_seconds": 0.5015})
    assert ms_delta(*hook, "hook_seconds") == pytest.approx(1.5)
    assert ms_delta(None, {"hook_seconds": 1.0}, "hook_seconds") is None
    copies = (
        {"hook_seconds": 1.0, "copy_seconds": 0.25},
        {"hook_seconds": 2.0, "copy_seconds": 0.5},
    )
    assert ms_delta(*copies, "copy_seconds") == pytest.approx(250.0)


def test_control_rows_report_the_miss_overhead_in_the_scheduler() -> None:
    def control(system: str, kind: str, ttft: float, **kw: object) -> ProbeRecord:
        rec = _rec(system, kind, ttft, [1, 2], donors=0, **kw)
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
    assert "0.050" in console_table([row], wide=True)  # hook ovh: a --wide column
    assert "0.050" not in console_table([row])


def test_url_option_is_validated() -> None:
    assert parse_urls(["vanilla=http://h:1", "exact_spans=http://h:2"]) == {
        "vanilla": "http://h:1",
        "exact_spans": "http://h:2",
    }
    for bad in ("http://h:1", "semantic=http://h:1", "vanilla=h:1"):
        with pytest.raises(click.BadParameter):
            parse_urls([bad])


def test_plan_servers_starts_every_chosen_system_that_no_url_names() -> None:
    urls = {"vanilla": "http://127.0.0.1:1"}
    mixed = plan_servers("vanilla,exact_spans", DEFAULT_SYSTEMS, urls, {})
    assert mixed == ServerPlan(["vanilla", "exact_spans"], urls, ["exact_spans"])
    # without --systems: the URL-named systems, in --url order, or else the default
    named = {"exact_spans": "http://h:2", "vanilla": "http://h:1"}
    assert plan_servers(None, DEFAULT_SYSTEMS, named, {}).systems == ["exact_spans", "vanilla"]
    assert plan_servers(None, DEFAULT_SYSTEMS, {}, {}).to_start == list(DEFAULT_SYSTEMS)
    # --semblend-env reaches the started semblend servers; a vanilla one at a URL is no matter
    env = {"SEMBLEND_MAX_SPANS": "4"}
    assert plan_servers("vanilla,exact_spans", DEFAULT_SYSTEMS, urls, env).to_start == [
        "exact_spans"
    ]
    with pytest.raises(click.BadParameter, match="applies to started servers only"):
        plan_servers("vanilla,exact_spans", DEFAULT_SYSTEMS, named, env)
    with pytest.raises(click.BadParameter, match="not among --systems"):
        plan_servers("vanilla", DEFAULT_SYSTEMS, named, {})


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


def _rec(
    system: str, kind: str, ttft: float, ids: list[int], donors: int = 1, **kw: object
) -> ProbeRecord:
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
        donors=donors,
        **kw,
    )  # type: ignore[arg-type]


def _markdown_cell(row: dict[str, Any], header: str) -> str:
    """The cell under ``header`` of ``row``'s line in the markdown table."""
    head, _, line = markdown_table([{"summary": [row]}]).splitlines()[:3]
    names = [c.strip() for c in head.strip("|").split("|")]
    return [c.strip() for c in line.strip("|").split("|")][names.index(header)]


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
    assert row["exact_spans_divergent_hits"] == 1  # parts at position 2
    assert row["exact_spans_divergence_margin"] is None  # the cold run recorded no margins
    margin_cell = _markdown_cell(row, "cold margin at divergence")
    assert margin_cell == "?"  # parted, margin unknown (a schema-4 report)
    assert "cross_instruction" in console_table([row])


def test_summary_reports_the_cold_margin_where_hits_part_from_cold() -> None:
    def probe(group: str, output: list[int], outcome: str) -> ProbeRecord:
        rec = _rec("exact_spans", "semantic", 1.0, output, outcome=outcome, reused_tokens=9)
        rec.group_id = group
        return rec

    records = []
    for group, margins in (("g0", [0.4, 0.3, 0.2]), ("g1", [0.9, 0.8, 0.7]), ("g2", [0.1] * 3)):
        cold = _rec("vanilla", "cold", 4.0, [1, 2, 3], margins=margins)
        cold.group_id = group
        records.append(cold)
    records.append(probe("g0", [1, 5, 3], "materialized"))  # parts at 1: 0.3
    records.append(probe("g1", [7, 2, 3], "materialized"))  # parts at 0: 0.9
    records.append(probe("g2", [1, 2, 8], "declined:no_donor"))  # not a hit: left out
    (row,) = summarize(records)
    assert row["exact_spans_divergent_hits"] == 2
    assert _markdown_cell(row, "cold margin at divergence") == "0.600"
    assert row["exact_spans_divergence_margin"] == pytest.approx(0.6)  # median of 0.3, 0.9
    assert row["exact_spans_divergence_margin_max"] == pytest.approx(0.9)


def test_kl_columns_split_hits_by_spans_beside_the_exact_hits_floor() -> None:
    """SGLang's KL measure per row: a semblend system's hits (one-span and multi-span apart),
    the exact hit of the same length and cold; a miss and a record without a replay count in
    none of them."""

    def run(system: str, kind: str, out: list[float], replay: list[float], **kw: Any) -> Any:
        return _rec(system, kind, 1.0, [1, 2], output_logprobs=out, replay_logprobs=replay, **kw)

    one = run(
        "exact_spans", "semantic", [-2.0, -1.0], [-1.0, -1.0], outcome="materialized", spans=1
    )
    multi = run(
        "exact_spans", "semantic", [-1.0, -1.0], [-1.0, -3.0], outcome="materialized", spans=3
    )
    miss = run(
        "exact_spans", "semantic", [-5.0, -1.0], [-1.0, -1.0], outcome="declined:no_donor", spans=0
    )
    unreplayed = run("exact_spans", "semantic", [-5.0], [], outcome="materialized", spans=1)
    records = [
        run("vanilla", "cold", [-1.0, -1.0], [-1.0, -1.0]),
        run("vanilla", "exact_same_length", [-1.0, -1.0], [-1.0, -1.0 + 1e-3]),
        one,
        multi,
        miss,
        unreplayed,
    ]
    (row,) = summarize(records)
    kl_one = (math.e - 2) / 2
    kl_multi = (math.exp(-2) + 1) / 2
    assert row["exact_spans_kl_one_span"] == pytest.approx(kl_one)
    assert row["exact_spans_kl_multi_span"] == pytest.approx(kl_multi)
    assert row["exact_spans_kl"] == pytest.approx((kl_one + kl_multi) / 2)
    assert row["exact_spans_kl_max"] == pytest.approx(max(kl_one, kl_multi))
    assert row["cold_kl"] == 0.0
    assert row["exact_kl"] == pytest.approx((math.exp(1e-3) - 1 - 1e-3) / 2)
    assert row["reorder_kl"] is None  # no reorder run
    assert _markdown_cell(row, "KL (hits)") == f"{(kl_one + kl_multi) / 2:.1e}"


@pytest.mark.e2e
def test_quick_run_against_the_cpu_servers(
    tmp_path: Path, smollm2_model_dir: Path, vanilla_server: SglangServer
) -> None:
    """``--quick`` with vanilla at the session's running vanilla server (``--url``: it is
    measured there, its tree found by its port and metered as the bench's own) and exact_spans
    started by the bench."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "semblend_sglang.bench", "--quick"]
    cmd += ["--workloads", "cross_instruction", "--systems", "vanilla,exact_spans"]
    cmd += ["--url", f"vanilla={vanilla_server.url}"]
    cmd += ["--model-path", str(smollm2_model_dir), "--out", str(out), "--repeats", "2"]
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
    records = report["records"]
    # systems interleaved per probe, the whole probe again in the second repeat
    kinds = ["semantic", "prefix", "cold", "exact_same_length"]
    assert [(r["repeat"], r["kind"]) for r in records] == [
        (k, kind) for k in (0, 1) for kind in kinds
    ]
    assert all(r["foreign_cores"] is not None and r["foreign_cores"] >= 0 for r in records)
    assert report["noise"]["rows"] == 1 and report["noise"]["foreign_cores_max"] is not None
    assert row["exact_spans_over_exact_n"] == 2 and row["exact_spans_speedup_n"] == 2
    assert isinstance(row["noisy"], bool)
    first = [r for r in records if r["repeat"] == 0]
    later = [r for r in records if r["repeat"] == 1]
    assert all(len(r["output_ids"]) == 1 and not r["reference_logprobs"] for r in later)
    semantic = [r for r in first if r["kind"] == "semantic"]
    assert semantic and all(len(r["reference_logprobs"]) == 64 for r in semantic)
    assert all(0 < r["hook_ms"] < 60_000 for r in semantic)  # the server's own hook time
    cold = [r for r in first if r["kind"] == "cold"]
    scored = cold + semantic  # the cold answer and the reused one (the post-hoc guard's signal)
    assert all(len(r["margins"]) == len(r["output_ids"]) > 0 for r in scored)
    assert all(m >= 0 for r in scored for m in r["margins"])  # top-1 minus top-2, from SGLang
    unscored = [r for r in report["records"] if r not in scored]
    assert unscored and all(r["margins"] == [] for r in unscored)
    assert {r["kind"] for r in report["records"]} == {
        "semantic",
        "prefix",
        "cold",
        "exact_same_length",
    }
    assert "cross_instruction" in proc.stdout
    # written group by group: the same records, in order, even had the run been cut short
    lines = (out / "e2e.records.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    # bench kl-along reads them back: the hit's row carries SGLang's KL of its answer
    along = subprocess.run(
        [sys.executable, "-m", "semblend_sglang.bench", "kl-along", str(out / "e2e.records.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert along.returncode == 0, along.stderr
    hit = next(ProbeRecord(**r) for r in first if r["outcome"] == "materialized")
    assert hit.kl is not None
    assert f"| {hit.group_id} | {hit.kl:.1e} |" in along.stdout
    # the started server's tree peaked above the fp32 weights it loaded (SmolLM2-135M: 0.5 GB);
    # the one --url named is not the bench's to stop or weigh
    assert "starting 1 SGLang servers (exact_spans)" in proc.stderr
    assert set(report["server_peak_rss_bytes"]) == {"exact_spans"} and vanilla_server.alive()
    assert all(b > 500_000_000 for b in report["server_peak_rss_bytes"].values())


@pytest.mark.e2e
def test_the_reorder_system_hits_sglang_exact_prefix_cache(
    tmp_path: Path, smollm2_model_dir: Path, vanilla_server: SglangServer
) -> None:
    """The lossless anchor on the real CPU server: vanilla SGLang (the shared vanilla server,
    named with ``--url``: the system's server is plain SGLang), after the donor, sent the
    qa_rag probe with its passages in the donor's order, so SGLang's own exact prefix cache
    serves every passage; its answer is scored against gold. (The pairing with vanilla's cold
    run is tests/test_bench_qa.py's.)"""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "semblend_sglang.bench", "--quick", "--repeats", "1"]
    cmd += [
        "--workloads",
        "qa_rag",
        "--systems",
        "reorder",
        "--url",
        f"reorder={vanilla_server.url}",
    ]
    cmd += ["--model-path", str(smollm2_model_dir), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "e2e.json").read_text())
    (row,) = report["summary"]
    runs = [r for r in report["records"] if r["system"] == "reorder"]
    assert [r["kind"] for r in runs] == ["reordered"] and len(runs[0]["output_ids"]) > 0
    assert row["reorder_cached_fraction"] > 0.8  # SGLang's own cached_tokens
    assert row["reorder_n"] == 1 and row["reorder_greedy_agreement"] is None  # no cold run
    (cells,) = row["qa_by_dataset"].values()
    assert cells["reorder"]["n"] == 1 and cells["reorder"]["paired"] == 0
    assert "reorder" in proc.stdout


def test_the_sglang_dispatch_system_is_exact_spans_without_donor_aware_dispatch() -> None:
    env = SERVER_ENV[SGLANG_DISPATCH]
    assert Config.from_env(env).dispatch_enabled is False
    assert Config.from_env(SERVER_ENV["exact_spans"]).dispatch_enabled is True
    assert {k: v for k, v in env.items() if k != "SEMBLEND_DISPATCH_ENABLED"} == SERVER_ENV[
        "exact_spans"
    ]
    assert SGLANG_DISPATCH in SYSTEMS and SGLANG_DISPATCH not in DEFAULT_SYSTEMS  # --systems only
    assert parse_urls([f"{SGLANG_DISPATCH}=http://h:3"]) == {SGLANG_DISPATCH: "http://h:3"}
    group = RequestGroup(
        "g0", (BenchRequest((1, 2), "donor"), BenchRequest((1, 3), "probe")), shared_spans=()
    )
    # donors and probes are sent to it like to exact_spans
    assert requests_per_group(group, ["exact_spans", SGLANG_DISPATCH]) == 4


def test_summary_puts_both_dispatches_side_by_side() -> None:
    records = [
        _rec("vanilla", "cold", 4.0, [1, 2]),
        _rec("exact_spans", "semantic", 1.0, [1, 2], outcome="materialized", reused_tokens=400),
        _rec(SGLANG_DISPATCH, "semantic", 3.9, [1, 2], outcome="declined:no_donor"),
    ]
    (row,) = summarize(records)
    assert row["exact_spans_hit_rate"] == 1.0 and row[f"{SGLANG_DISPATCH}_hit_rate"] == 0.0
    assert row[f"{SGLANG_DISPATCH}_ms_p50"] == pytest.approx(3900.0)
    assert row[f"{SGLANG_DISPATCH}_reused_fraction"] == 0.0
    table = console_table([row], wide=True)
    assert "sgl-dp hit%" in table and "3900" in table


def test_started_dp_servers_on_cpu_bind_one_core_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    assert dp_size_of(["--dp-size", "2"]) == 2 and dp_size_of(["--dp-size=4"]) == 4
    assert dp_size_of(["--data-parallel-size", "3"]) == 3 and dp_size_of(["--tp", "2"]) == 1
    assert cpu_dp_environ(["--dp-size", "2"], cpu=True) == {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    assert cpu_dp_environ(["--dp-size", "2"], cpu=False) == {}  # GPUs: SGLang's own placement
    assert cpu_dp_environ([], cpu=True) == {}
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|0")
    assert cpu_dp_environ(["--dp-size", "2"], cpu=True) == {}  # the caller's binding wins
