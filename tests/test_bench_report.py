"""The e2e job's report of a user's mixed ``--workload`` file: the real command (workload file,
runner, summary, console table, JSON, plot) against two small real HTTP servers that answer like
a vanilla and a semblend SGLang server (tests/sglang_like_server.py). The file mixes RAG,
template, unrelated-donor and control requests; the table, the JSON summary and the plot break
down by their ``label``, each row naming the recompute settings the semblend server resolved and
what its recompute budget and quality gate (which declines one template probe) did. The plot's
choice (grouped bars for one context length, a panel per row for several) and its no-hit marks
are checked on the drawn figure's artists."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from click.testing import CliRunner
from sglang_like_server import RESOLVED_CONFIG, ServerState, serve

from semblend_sglang.bench.e2e import SCHEMA_VERSION, command
from semblend_sglang.bench.e2e_runner import ProbeRecord
from semblend_sglang.bench.e2e_summary import row_name, summarize
from semblend_sglang.bench.plot import (
    NO_HIT,
    NO_HIT_HEIGHT,
    bar_x,
    figure,
    quality_bars,
    ttft_bars,
    ttft_lines,
)
from semblend_sglang.bench.report import console_table
from semblend_sglang.bench.workload_file import load_workload_file

LABELS = ("rag", "template", "control", "unrelated")
REPEATS = 2
"""Each probe measured twice: counts and quality come from the first repeat, TTFT from both."""
"""The file's labels in order of first appearance (its groups interleave them)."""


def _mixed_lines(essays: list[str]) -> list[dict[str, Any]]:
    def passages(k: int) -> str:
        return "\n\n".join(f"Passage {j + 1}: {essays[3 * k + j][:500]}" for j in range(3))

    def template(date: str, k: int) -> str:
        return f"You are a helpful assistant.\nDate: {date}\nUser: Alice\n\n{essays[10 + k][:900]}"

    question = "\n\nQuestion: What do these passages have in common?\nAnswer:"
    rag = [
        [
            {"prompt": f"Answer from the passages below.\n\n{passages(k)}{question}"},
            {"prompt": f"Use only these sources.\n\n{passages(k)}{question}", "reference": " All"},
        ]
        for k in range(2)
    ]
    templates = [
        [{"prompt": template("2026-01-05", k)}, {"prompt": template("2026-02-17", k)}]
        for k in range(2)
    ]
    control = [[{"prompt": essays[20 + k][:1500], "role": "probe"}] for k in range(2)]
    unrelated = [[{"prompt": essays[30][:1200]}, {"prompt": essays[31][:1200]}]]
    order = [
        ("rag", 0, rag[0]),
        ("template", 0, templates[0]),
        ("control", 0, control[0]),
        ("rag", 1, rag[1]),
        ("unrelated", 0, unrelated[0]),
        ("template", 1, templates[1]),
        ("control", 1, control[1]),
    ]
    return [
        {"group": f"{label}-{k}", **line, "label": label}
        for label, k, group in order
        for line in group
    ]


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory,
    essay_texts: list[str],
    smollm2_model_dir: Path,
    smollm2_tokenizer: Any,
) -> Iterator[tuple[str, dict[str, Any], Path]]:
    """The command's console output, its JSON report and the workload file's path. The
    semblend server's quality gate declines the probe of group ``template-1``."""
    root = tmp_path_factory.mktemp("mixed")
    path = root / "mixed.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in _mixed_lines(essay_texts)))
    groups = load_workload_file(path, smollm2_tokenizer).groups
    (gated,) = next(g for g in groups if g.group_id == "template-1").probes
    fast = {"prefill_s_per_token": 1e-5}
    with (
        serve(ServerState(semblend=False, **fast)) as vanilla,
        serve(
            ServerState(semblend=True, gated=lambda p: p == gated.prompt_ids, **fast)
        ) as semblend,
    ):
        result = CliRunner().invoke(
            command,
            [
                "--workload",
                str(path),
                "--url",
                f"vanilla={vanilla.url}",
                "--url",
                f"exact_spans={semblend.url}",
                "--model-path",
                str(smollm2_model_dir),
                "--out",
                str(root / "out"),
                "--repeats",
                str(REPEATS),
                "--wide",
            ],
        )
    assert result.exit_code == 0, result.output
    yield result.stdout, json.loads((root / "out" / "e2e.json").read_text()), path


def test_json_summary_has_one_row_per_label(run: tuple[str, dict[str, Any], Path]) -> None:
    _, report, path = run
    assert report["schema_version"] == SCHEMA_VERSION
    assert report["options"]["workload_file"] == str(path)
    assert report["options"]["systems"] == ["vanilla", "exact_spans"]
    rows = report["summary"]
    assert [(r["workload"], r["label"]) for r in rows] == [("mixed", label) for label in LABELS]
    assert len({r["context_tokens"] for r in rows}) == 1  # a file has one nominal length
    by = {r["label"]: r for r in rows}
    assert report["semblend_config"] == {"exact_spans": RESOLVED_CONFIG}  # what it resolved
    for row in rows:
        assert row["exact_spans_recompute_strategy"] == "deviation"
        assert row["exact_spans_recompute_ratio"] == 0.15
        assert row["exact_spans_recompute_check_layer"] == 1
        assert row["exact_spans_quality_gate"] == 0.0
    assert [by[label]["exact_spans_gate_declines"] for label in LABELS] == [0, 1, 0, 0]
    assert by["rag"]["exact_spans_recompute_share"] == pytest.approx(0.15, abs=0.01)
    assert by["template"]["exact_spans_recompute_share"] > 0.5  # one probe fully recomputed
    for label in ("control", "unrelated"):  # nothing matched a donor
        assert by[label]["exact_spans_recomputed_tokens"] == 0
        assert by[label]["exact_spans_recompute_share"] is None
    assert (
        by["rag"]["exact_spans_hit_rate"] == 1.0 and by["template"]["exact_spans_hit_rate"] == 0.5
    )
    for label in ("rag", "template"):  # the donor's text behind another head: reused
        assert (
            by[label]["exact_spans_n"] == 2 * REPEATS
            and by[label]["exact_spans_recomputed_tokens"] > 0
        )
        assert by[label]["control"] is False and "exact_spans_miss_overhead" not in by[label]
        assert by[label]["exact_spans_greedy_agreement"] == 1.0
        assert by[label]["cold_n"] == 2 * REPEATS and by[label]["prefix_n"] == 2 * REPEATS
        # paired per (group, probe, repeat): every probe that reused has an exact twin
        row = by[label]
        assert row["exact_spans_speedup_n"] == 2 * REPEATS
        assert row["exact_spans_speedup_min"] <= row["exact_spans_speedup"]
        assert row["exact_spans_speedup"] <= row["exact_spans_speedup_max"]
        assert row["exact_spans_ms_min"] <= row["exact_spans_ms_p50"] <= row["exact_spans_ms_max"]
        assert isinstance(row["noisy"], bool) and (row["noisy_why"] is None) != row["noisy"]
        # a hit's hook time and its copy's part, read from the server's counters per probe
        assert row["exact_spans_hit_hook_ms"] == pytest.approx(0.5)
        assert row["exact_spans_hit_copy_ms"] == pytest.approx(0.3)
    assert by["rag"]["exact_spans_ppl_ratio"] == pytest.approx(1.0)  # only rag has references
    assert by["template"]["exact_spans_ppl_ratio"] is None
    assert by["unrelated"]["exact_spans_hit_rate"] == 0.0 and by["unrelated"]["control"] is False
    control = by["control"]
    assert control["control"] is True and control["exact_spans_hit_rate"] == 0.0
    assert control["prefix_n"] == 0 and control["exact_same_length_n"] == 0  # no donor
    assert isinstance(control["exact_spans_miss_overhead"], float)
    assert control["exact_spans_miss_overhead_n"] == 2 * REPEATS  # both probes, every repeat
    assert report["options"]["repeats"] == REPEATS
    # --url servers that listen on this machine (these stand-ins: this process) are metered
    # as the bench's own (bench.machine_load.listening_pid): the load is measured
    assert report["noise"]["foreign_cores_max"] >= 0
    assert control["exact_spans_miss_hook_ms"] == pytest.approx(0.5)  # the server's own counter
    assert control["exact_spans_hit_copy_ms"] is None  # no hit, nothing copied


def test_records_carry_labels_and_rebuild_the_summary(
    run: tuple[str, dict[str, Any], Path],
) -> None:
    _, report, _ = run
    records = [ProbeRecord(**r) for r in report["records"]]
    assert {r.label for r in records} == set(LABELS)
    assert all((r.donors == 0) == (r.label == "control") for r in records)
    gated = [r for r in records if r.outcome == "declined:quality_gate"]
    assert [(r.group_id, r.reused_tokens) for r in gated] == [("template-1", 0)] * REPEATS
    assert gated[0].recomputed_tokens and gated[0].recomputed_tokens > 0
    configs = report["semblend_config"]
    assert summarize(records, by_label=True, configs=configs) == report["summary"]
    (whole,) = summarize(records, configs=configs)  # without the breakdown: one averaged row
    assert whole["label"] is None and whole["exact_spans_n"] == 7 * REPEATS
    assert whole["exact_spans_hit_rate"] == pytest.approx(3 / 7)
    assert whole["exact_spans_gate_declines"] == 1


def test_console_table_has_one_line_per_label(run: tuple[str, dict[str, Any], Path]) -> None:
    """The ``--wide`` table (every column)."""
    out, report, _ = run
    lines = out.splitlines()
    names = [row_name(r) for r in report["summary"]]
    assert names == [f"mixed:{label}" for label in LABELS]
    table = [line for line in lines if line.startswith("mixed:")]
    assert [line.split()[0] for line in table] == names
    control = table[LABELS.index("control")].split()
    assert control[9] == "0"  # hit%: no hit on the control row
    assert control[-5:-1] == ["deviation", "15%", "-", "0"]  # nothing to recompute, no decline
    assert control[-1] in ("ok", "!")  # the noise flag
    narrow = console_table(report["summary"]).splitlines()
    assert max(len(line) for line in narrow) <= 120
    narrow_head = "cold exact spans speedup hit% reuse% agree kl ex kl noise"
    assert narrow[0].split()[2:] == narrow_head.split()
    template = table[LABELS.index("template")].split()[:-1]
    share = (
        100
        * next(r for r in report["summary"] if r["label"] == "template")[
            "exact_spans_recompute_share"
        ]
    )
    assert template[-4:-1] == ["deviation", "15%", f"{share:.0f}"]
    assert template[-1] == "1"  # the gate's one decline
    assert lines.index(
        "exact_spans: recompute_strategy=deviation recompute_ratio=0.15 recompute_check_layer=1 "
        "recompute_recheck_depth=0.5 recompute_recheck_width=3.0 recompute_check_share=0.15 "
        "recompute_check_max_spans=1 "
        "recompute_check_span_limit=128 "
        "recompute_min_deviation=0.0001 "
        "quality_gate=0.0"
    ) < lines.index(next(line for line in lines if line.startswith("workload")))


def _bars(ax: Any) -> list[Any]:
    """The regular bars of ``ax`` (not the no-hit stubs), as patches."""
    return [p for p in ax.patches if p.get_gid() != NO_HIT]


def test_one_context_length_plots_grouped_bars_per_label(
    run: tuple[str, dict[str, Any], Path],
) -> None:
    _, report, _ = run
    rows = report["summary"]
    chart = ttft_bars(rows)
    assert chart.categories == tuple(f"mixed:{label}" for label in LABELS)
    assert chart.series == (
        "cold (vanilla)",
        "vanilla, donor cached",
        "exact hit, same length",
        "semblend exact_spans",
    )
    fig = figure(rows)
    ttft_ax, _ = fig.axes
    assert not ttft_ax.lines  # bars, not a line through one point per system
    assert [t.get_text() for t in ttft_ax.get_xticklabels()] == list(chart.categories)
    assert [t.get_text() for t in ttft_ax.get_legend().get_texts()] == list(chart.series)
    drawn = {(round(p.get_x() + p.get_width() / 2, 6), p.get_height()) for p in _bars(ttft_ax)}
    expected = {
        (round(bar_x(chart, s, c), 6), v)
        for s, values in enumerate(chart.values)
        for c, v in enumerate(values)
        if v is not None
    }
    assert drawn == expected
    control = chart.categories.index("mixed:control")
    assert chart.values[chart.series.index("vanilla, donor cached")][control] is None  # no donor
    plt.close(fig)


def test_quality_marks_cells_with_no_hit_instead_of_drawing_them(
    run: tuple[str, dict[str, Any], Path],
) -> None:
    _, report, _ = run
    rows = report["summary"]
    chart = quality_bars(rows)
    assert chart.categories == ("mixed:rag", "mixed:template", "mixed:unrelated")  # no control
    assert chart.series == ("exact_spans: greedy agreement", "exact_spans: ROUGE-L")
    unrelated = chart.categories.index("mixed:unrelated")
    assert chart.no_hit == {(0, unrelated), (1, unrelated)}
    assert all(values[unrelated] is None for values in chart.values)
    by = {r["label"]: r for r in rows}
    assert by["unrelated"]["exact_spans_greedy_agreement"] == 1.0  # what was drawn before
    assert by["unrelated"]["exact_spans_greedy_agreement_hits"] is None  # no hit to judge
    assert by["rag"]["exact_spans_rouge_l_hits"] == by["rag"]["exact_spans_rouge_l"]  # all hits
    fig = figure(rows)
    quality_ax = fig.axes[1]
    stubs = [p for p in quality_ax.patches if p.get_gid() == NO_HIT]
    marks = [t for t in quality_ax.texts if t.get_text() == NO_HIT]
    where = sorted(round(bar_x(chart, s, c), 6) for s, c in chart.no_hit)
    assert sorted(round(p.get_x() + p.get_width() / 2, 6) for p in stubs) == where
    assert sorted(round(t.get_position()[0], 6) for t in marks) == where
    assert all(p.get_height() == NO_HIT_HEIGHT and not p.get_fill() for p in stubs)
    bar_centres = {round(p.get_x() + p.get_width() / 2, 6) for p in _bars(quality_ax)}
    assert not bar_centres & set(where)  # no quality bar drawn for a no-hit cell
    assert len(_bars(quality_ax)) == 4  # rag and template, two series each
    plt.close(fig)


def test_several_context_lengths_plot_one_panel_per_row_name(
    run: tuple[str, dict[str, Any], Path],
) -> None:
    _, report, _ = run
    records = [ProbeRecord(**r) for r in report["records"]]
    ctx = records[0].context_tokens
    longer = [replace(r, context_tokens=2 * ctx, ttft_s=2 * r.ttft_s) for r in records]
    rows = summarize(records + longer, by_label=True)
    lines = ttft_lines(rows)
    assert list(lines) == [f"mixed:{label}" for label in LABELS]
    assert all(xs == [ctx, 2 * ctx] for panel in lines.values() for _, xs, _ in panel)
    fig = figure(rows)
    *panels, quality_ax, legend_ax = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == len(LABELS)
    for ax, (name, panel) in zip(panels, lines.items(), strict=True):
        assert ax.get_title().endswith(name)
        assert [list(line.get_xdata()) for line in ax.lines] == [xs for _, xs, _ in panel]
        assert [line.get_label() for line in ax.lines] == [label for label, _, _ in panel]
    colors = {line.get_label(): line.get_color() for ax in panels for line in ax.lines}
    assert len(set(colors.values())) == len(colors)  # one color per series in every panel
    assert quality_ax.get_title().startswith("Quality")
    legend = [t.get_text() for t in legend_ax.get_legend().get_texts()]
    assert set(legend) == set(colors)
    assert quality_bars(rows).no_hit == {(0, 2), (1, 2)}  # unrelated: no hit at either length
    plt.close(fig)
