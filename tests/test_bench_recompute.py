"""The e2e bench's report of the recompute budget (issue 14): the settings each semblend server
resolved (the snapshot's ``config``), the recomputed tokens and the quality gate's declines per
workload and context length, in the summary rows, the console table and the JSON; a server from
before the budget (no ``config``, no ``recomputed_tokens``) still works, reported as unknown / 0.
The runner talks to small real HTTP servers that answer like SGLang (tests/sglang_like_server.py);
the whole command with a workload file is tests/test_bench_report.py. ``bench table`` puts
several runs' rows (one run per setting) in one markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sglang_like_server import RESOLVED_CONFIG, ServerState, serve

from semblend_sglang.bench.client import ServerClient, semblend_config, semblend_state
from semblend_sglang.bench.e2e_runner import ProbeRecord, Runner
from semblend_sglang.bench.e2e_summary import RECOMPUTE_SETTINGS, summarize
from semblend_sglang.bench.e2e_table import command as table_command
from semblend_sglang.bench.e2e_table import markdown_table
from semblend_sglang.bench.report import console_table, recompute_label, settings_lines
from semblend_sglang.bench.snapshot_deltas import counter_delta, declined_reasons, residual_delta
from semblend_sglang.bench.systems import (
    SERVER_ENV,
    parse_semblend_env,
    system_environ,
)
from semblend_sglang.bench.workloads import BenchRequest, RequestGroup, Workload

SHARED = tuple(range(1000, 1200))
"""200 tokens every probe shares with its group's donor: reused behind a different head."""


def _workload(name: str, context_tokens: int, head: int) -> Workload:
    """One group: a donor, then a probe that ends like it (a hit on the semblend servers)."""
    donor = BenchRequest((head, head + 1, *SHARED), "donor")
    probe = BenchRequest((head, head + 2, *SHARED), "probe", label=name)
    return Workload(name, context_tokens, (RequestGroup(f"{name}-0", (donor, probe)),))


def _run(state: ServerState, workloads: list[Workload]) -> Runner:
    """The runner's groups against a vanilla server and a semblend one with ``state``."""
    with serve(ServerState(semblend=False)) as vanilla, serve(state) as semblend:
        clients = {"vanilla": ServerClient(vanilla.url), "exact_spans": ServerClient(semblend.url)}
        runner = Runner(clients, greedy_tokens=4)
        for workload in workloads:
            for group in workload.groups:
                runner.run_group(workload, group)
    return runner


def _semantic(runner: Runner, workload: str) -> ProbeRecord:
    (rec,) = [r for r in runner.records if r.workload == workload and r.kind == "semantic"]
    return rec


def test_counter_delta_and_declined_reasons() -> None:
    before = {"reused_tokens": 10, "recomputed_tokens": 4}
    assert (
        counter_delta(before, {"reused_tokens": 30, "recomputed_tokens": 9}, "recomputed_tokens")
        == 5
    )
    assert counter_delta({"reused_tokens": 1}, {"reused_tokens": 2}, "recomputed_tokens") == 0
    assert counter_delta(None, before, "reused_tokens") == 0
    assert declined_reasons("declined:no_donor,quality_gate") == {"no_donor", "quality_gate"}
    assert declined_reasons("materialized") == frozenset() and declined_reasons(None) == frozenset()


def test_residual_delta_is_the_mean_over_the_checks_run_between_snapshots() -> None:
    before = {"recompute_checks": 3, "recompute_residual_deviation_sum": 0.5}
    after = {"recompute_checks": 5, "recompute_residual_deviation_sum": 0.9}
    assert residual_delta(before, after) == pytest.approx(0.2)
    assert residual_delta(before, before) is None  # no check ran
    assert residual_delta(None, after) is None
    assert residual_delta({}, {}) is None  # a server without the counters


def test_client_reads_the_resolved_config_beside_the_counters() -> None:
    with serve(ServerState()) as server:
        state = semblend_state(server.url)
        assert state is not None and set(state) == {"ranks", "total", "config"}
        assert state["total"]["recomputed_tokens"] == 0
        assert semblend_config(server.url) == RESOLVED_CONFIG
        assert ServerClient(server.url).config() == RESOLVED_CONFIG
        server.state = ServerState(config=None, recompute_counter=False)  # an older server
        assert semblend_config(server.url) is None
        assert "recomputed_tokens" not in (ServerClient(server.url).snapshot() or {})
        server.state = ServerState(semblend=False)  # vanilla: no route
        assert semblend_state(server.url) is None and semblend_config(server.url) is None


def test_gate_declines_and_recomputed_tokens_land_in_their_own_cell() -> None:
    heads_5 = dict(RESOLVED_CONFIG, recompute_strategy="heads", recompute_ratio=0.05)
    gated_head = 7
    state = ServerState(config=heads_5, gated=lambda prompt: prompt[0] == gated_head)
    workloads = [_workload("rag", 512, 3), _workload("rag", 1024, gated_head)]
    workloads.append(_workload("template", 512, 11))
    runner = _run(state, workloads)
    assert runner.configs == {"exact_spans": heads_5}  # read from the server, vanilla absent
    hit = _semantic(runner, "template")
    copied = len(SHARED)  # the server's common suffix
    assert (hit.outcome, hit.recomputed_tokens) == ("materialized", int(0.05 * copied))
    assert hit.reused_tokens == copied - int(0.05 * copied)
    gated = [r for r in runner.records if r.context_tokens == 1024 and r.kind == "semantic"]
    assert [(r.outcome, r.reused_tokens, r.recomputed_tokens) for r in gated] == [
        ("declined:quality_gate", 0, copied)
    ]
    assert all(r.recomputed_tokens is None for r in runner.records if r.system == "vanilla")

    rows = {
        (r["workload"], r["context_tokens"]): r
        for r in summarize(runner.records, configs=runner.configs)
    }
    assert set(rows) == {("rag", 512), ("rag", 1024), ("template", 512)}
    for row in rows.values():  # every cell names what the server resolved
        assert row["exact_spans_recompute_strategy"] == "heads"
        assert row["exact_spans_recompute_ratio"] == 0.05
        assert row["exact_spans_recompute_check_layer"] == 1
        assert row["exact_spans_quality_gate"] == 0.0
    assert [rows[k]["exact_spans_gate_declines"] for k in sorted(rows)] == [0, 1, 0]
    assert rows[("rag", 1024)]["exact_spans_hit_rate"] == 0.0
    assert rows[("rag", 1024)]["exact_spans_recomputed_tokens"] == copied
    assert rows[("rag", 1024)]["exact_spans_recompute_share"] == 1.0
    assert rows[("rag", 512)]["exact_spans_recomputed_tokens"] == int(0.05 * copied)
    assert rows[("rag", 512)]["exact_spans_recompute_share"] == pytest.approx(
        int(0.05 * copied) / copied
    )

    table = console_table(list(rows.values()), wide=True).splitlines()
    head = table[0].split()
    assert head[-4:] == ["recompute", "recomp%", "gated", "noise"]
    gated_line = next(line for line in table if line.startswith("rag") and " 1024 " in line)
    assert gated_line.split()[-5:-1] == ["heads", "5%", "100", "1"]
    assert settings_lines(runner.configs) == [
        "exact_spans: recompute_strategy=heads recompute_ratio=0.05 recompute_check_layer=1 "
        "recompute_recheck_depth=0.5 recompute_recheck_width=3.0 recompute_check_share=0.15 "
        "recompute_check_max_spans=1 "
        "recompute_check_span_limit=128 "
        "recompute_min_deviation=0.0001 "
        "quality_gate=0.0"
    ]


def test_a_server_without_the_recompute_keys_reports_them_unknown_and_zero() -> None:
    older = ServerState(config=None, recompute_counter=False)
    runner = _run(older, [_workload("rag", 512, 3)])
    assert runner.configs == {"exact_spans": None}
    rec = _semantic(runner, "rag")
    assert rec.outcome == "materialized" and rec.reused_tokens == len(SHARED)
    assert rec.recomputed_tokens == 0  # no counter: nothing seen recomputed
    (row,) = summarize(runner.records, configs=runner.configs)
    assert all(row[f"exact_spans_{k}"] is None for k in RECOMPUTE_SETTINGS)
    assert row["exact_spans_gate_declines"] == 0 and row["exact_spans_recomputed_tokens"] == 0
    assert row["exact_spans_recompute_share"] == 0.0
    assert recompute_label(row) == "? ?"
    assert settings_lines(runner.configs) == ["exact_spans: settings not reported"]
    assert console_table([row], wide=True).splitlines()[2].split()[-5:-1] == ["?", "?", "0", "0"]
    # A config without the new keys (a semblend server from before them) reads the same.
    (row,) = summarize(runner.records, configs={"exact_spans": {"mode": "exact_spans"}})
    assert recompute_label(row) == "? ?"
    assert settings_lines({"exact_spans": {"mode": "exact_spans"}}) == [
        "exact_spans: recompute_strategy=? recompute_ratio=? recompute_check_layer=? "
        "recompute_recheck_depth=? recompute_recheck_width=? recompute_check_share=? "
        "recompute_check_max_spans=? "
        "recompute_check_span_limit=? "
        "recompute_min_deviation=? "
        "quality_gate=?"
    ]
    (row,) = summarize(runner.records)  # no configs at all (records read back from a JSON)
    assert row["exact_spans_recompute_strategy"] is None


def test_rows_without_a_semblend_system_have_no_recompute_cell() -> None:
    rec = ProbeRecord("rag", 512, "g0", 0, "vanilla", "cold", 1.0, 512, 0, donors=1)
    (row,) = summarize([rec], configs={"exact_spans": dict(RESOLVED_CONFIG)})
    assert "exact_spans_recompute_strategy" not in row and recompute_label(row) is None
    assert console_table([row], wide=True).splitlines()[2].split()[-4:-1] == ["-", "-", "-"]


def test_recompute_label_formats_the_ratio_as_a_percentage() -> None:
    def label(strategy: Any, ratio: Any) -> str | None:
        row = {"exact_spans_recompute_strategy": strategy, "exact_spans_recompute_ratio": ratio}
        return recompute_label(row)

    assert label("deviation", 0.15) == "deviation 15%"
    assert label("query", 0.3) == "query 30%"
    assert label("heads", 0.0) == "heads 0%"
    assert label("heads", 0.125) == "heads 12.5%"
    assert label(None, 0.05) == "? 5%"


def test_semblend_env_reaches_the_semblend_servers_only() -> None:
    chosen = {"SEMBLEND_RECOMPUTE_STRATEGY": "heads", "SEMBLEND_RECOMPUTE_RATIO": "0.05"}
    for system in ("exact_spans", "substitute"):
        env = system_environ(system, [], chosen)
        assert env == {**chosen, **SERVER_ENV[system]}
    assert system_environ("vanilla", [], chosen) == SERVER_ENV["vanilla"]
    # the system's own variables win over --semblend-env
    assert system_environ("exact_spans", [], {"SEMBLEND_MODE": "substitute"})["SEMBLEND_MODE"] == (
        "exact_spans"
    )


def test_semblend_env_accepts_the_recompute_settings() -> None:
    values = [
        "SEMBLEND_RECOMPUTE_STRATEGY=heads",
        "SEMBLEND_RECOMPUTE_RATIO=0.05",
        "SEMBLEND_RECOMPUTE_CHECK_LAYER=2",
        "SEMBLEND_QUALITY_GATE=0.3",
    ]
    assert parse_semblend_env(values) == dict(v.split("=") for v in values)


def test_markdown_table_puts_each_workloads_settings_side_by_side(tmp_path: Path) -> None:
    workloads = [_workload("rag", 512, 3), _workload("template", 512, 11)]
    reports = []
    for strategy, ratio in (("query", 0.3), ("heads", 0.05), ("heads", 0.0)):
        config = dict(RESOLVED_CONFIG, recompute_strategy=strategy, recompute_ratio=ratio)
        runner = _run(ServerState(config=config), workloads)
        reports.append({"summary": summarize(runner.records, configs=runner.configs)})
    older = _run(ServerState(config=None, recompute_counter=False), workloads[:1])
    reports.append({"summary": summarize(older.records)})  # like a schema-3 report
    lines = markdown_table(reports).splitlines()
    assert lines[0].startswith("| strategy | ratio | min dev | check | workload | ctx | cold |")
    assert lines[0].endswith(
        "| gate declines | greedy agree (hits) | cold margin at divergence | PPL ratio "
        "| KL (hits) | KL (exact hit) |"
    )
    assert lines[1] == "|" + "---|" * 20
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[:6] for c in cells] == [
        ["?", "?", "?", "?", "rag", "512"],
        ["heads", "0%", "1e-04", "15%", "rag", "512"],
        ["heads", "5%", "1e-04", "15%", "rag", "512"],
        ["query", "30%", "1e-04", "15%", "rag", "512"],
        ["heads", "0%", "1e-04", "15%", "template", "512"],
        ["heads", "5%", "1e-04", "15%", "template", "512"],
        ["query", "30%", "1e-04", "15%", "template", "512"],
    ]
    cells = [c[:3] + c[4:] for c in cells]  # past the check share, the columns as before it
    share = {(c[0], c[1], c[3]): c[12] for c in cells}
    assert share[("heads", "0%", "rag")] == "0%" and share[("query", "30%", "rag")] == "30%"
    assert all(c[10] == "100%" and c[13] == "0" for c in cells if c[0] != "?")
    assert all(float(c[9]) > 0 for c in cells)  # cold / spans, paired per probe
    assert all(c[15] == "—" for c in cells)  # every hit agrees with cold: no margin
    assert cells[0][13] == "0" and cells[0][16] == "—"  # no references: no PPL ratio
    paths = []
    for i, report in enumerate(reports):
        paths.append(tmp_path / f"e2e-{i}.json")
        paths[-1].write_text(json.dumps(report))
    result = CliRunner().invoke(table_command, [str(p) for p in paths])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == lines
