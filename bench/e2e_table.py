"""``bench table E2E.json ...``: the exact_spans rows of several e2e reports as one markdown
table, one line per report and row, sorted so that each workload's recompute strategies and
ratios sit together (docs/perf-archive.md's strategy × ratio × workload table: one e2e run
per setting, e.g. ``--semblend-env SEMBLEND_RECOMPUTE_STRATEGY=heads --semblend-env
SEMBLEND_RECOMPUTE_RATIO=0.05``). Strategy and ratio are what each run's server resolved (the
rows' ``exact_spans_recompute_strategy`` and ``_ratio``, JSON schema 4 and later); a report
without them (schema 3) shows ``?``. Rows with QA probes add a second table, one line per row,
dataset and system: each dataset's scores cold and with reuse, agreement with cold and
McNemar's paired test (:func:`.qa_summary.qa_columns`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from .e2e_runner import ProbeRecord
from .e2e_summary import row_name
from .qa_summary import qa_columns, qa_lines
from .report import QA_COLUMNS, qa_cell_values, ratio_label

MARGIN_KEY = "exact_spans_divergence_margin"

MARKDOWN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("cold", "cold_ms_p50", ",.0f"),
    ("exact hit, same length", "exact_same_length_ms_p50", ",.0f"),
    ("exact_spans", "exact_spans_ms_p50", ",.0f"),
    ("spans / exact", "exact_spans_over_exact", ".2f"),
    ("speed-up (cold / spans)", "exact_spans_speedup", ".2f"),
    ("hit (server)", "exact_spans_hit_rate", ".0%"),
    ("reused", "exact_spans_reused_fraction", ".0%"),
    ("recomputed", "exact_spans_recompute_share", ".0%"),
    ("gate declines", "exact_spans_gate_declines", "d"),
    ("greedy agree (hits)", "exact_spans_greedy_agreement_hits", ".2f"),
    ("cold margin at divergence", MARGIN_KEY, ".3f"),
    ("PPL ratio", "exact_spans_ppl_ratio", ".3f"),
    ("KL (hits)", "exact_spans_kl", ".1e"),
    ("KL (exact hit)", "exact_kl", ".1e"),
)
"""Columns after strategy, ratio, workload and context length: (header, summary key, format).
TTFT p50 in ms; ``spans / exact`` and ``speed-up``: medians of per-probe paired ratios;
``recomputed``: share of reused + recomputed tokens; ``cold margin at
divergence``: median over the hits that part from cold of the cold run's top-1 / top-2 logprob
margin where they part (``—``: none parts; ``?``: some part, but the report has no margins);
``KL``: SGLang's KL measure, mean over the hits and over the exact hits of the same length."""

QA_MARKDOWN_HEADERS = {
    "=cold": "answer = cold",
    "agree": "greedy agree",
    "b/c": "b / c",
    "p": "McNemar p",
}
"""Markdown headers of the console's short ones (the others are the same)."""

QA_MARKDOWN_COLUMNS: tuple[tuple[str, str, str], ...] = tuple(
    (QA_MARKDOWN_HEADERS.get(head, head), key, spec) for head, key, spec in QA_COLUMNS
)
"""The QA table's columns after the settings, workload, context length, dataset and system:
(header, key of :func:`.report.qa_cell_values`, format); see :data:`.report.QA_TABLE_LEGEND`."""

QA_HEADING = (
    "QA, each dataset on its own (first repeat; n: probes scored, with (k) when only k have a "
    "cold run, over which the cold and paired columns are; acc: yes/no or number right; EM, "
    "F1: SQuAD span scores; answer = cold: normalized answer equals cold's; b / c: right cold "
    "and wrong with reuse / the reverse (right: yes/no or number correct or exact match); "
    "McNemar p: exact two-sided):"
)


def _cell(row: Mapping[str, Any], key: str, spec: str) -> str:
    value = row.get(key)
    if value is not None:
        return format(value, spec)
    if key == MARGIN_KEY and row.get("exact_spans_divergent_hits"):
        return "?"  # hits parted from cold, but the cold run recorded no margins
    return "—"


def _floor_label(value: float | None) -> str:
    """``recompute_min_deviation`` as resolved: ``0`` (off), e.g. ``1e-04``, or ``?``."""
    if value is None:
        return "?"
    return "0" if value == 0 else f"{value:.0e}"


def _share_label(value: float | None) -> str:
    """``recompute_check_share`` as resolved: e.g. ``30%``, ``100%`` (a dense check), or ``?``."""
    return "?" if value is None else f"{value * 100:.0f}%"


def _settings(row: Mapping[str, Any]) -> list[str]:
    return [
        row.get("exact_spans_recompute_strategy") or "?",
        ratio_label(row.get("exact_spans_recompute_ratio")),
        _floor_label(row.get("exact_spans_recompute_min_deviation")),
        _share_label(row.get("exact_spans_recompute_check_share")),
        row_name(row),
        str(row["context_tokens"]),
    ]


def _order(row: Mapping[str, Any]) -> tuple[Any, ...]:
    ratio = row.get("exact_spans_recompute_ratio")
    return (
        row["context_tokens"],
        row_name(row),
        row.get("exact_spans_recompute_strategy") or "",
        ratio is None,
        ratio or 0.0,
        row.get("exact_spans_recompute_min_deviation") or 0.0,
        row.get("exact_spans_recompute_check_share") or 0.0,
    )


def _with_qa(report: Mapping[str, Any], row: Mapping[str, Any]) -> Mapping[str, Any]:
    """``row`` with ``qa_by_dataset``: its own (schema 11), else computed from the report's
    ``records`` of the row (schema 8 to 10, whose rows hold only the cross-dataset figures)."""
    if "qa_by_dataset" in row or not row.get("qa_probes") or not report.get("records"):
        return row
    label = row.get("label")
    mine = [
        rec
        for rec in (ProbeRecord(**data) for data in report["records"])
        if rec.workload == row["workload"]
        and rec.context_tokens == row["context_tokens"]
        and (label is None or rec.label == label)
    ]
    return {**row, "qa_by_dataset": qa_columns(mine)["qa_by_dataset"]}


def _qa_cells(source: str, cell: Mapping[str, Any]) -> list[str]:
    values = qa_cell_values(source, cell)
    return [
        "—" if values.get(key) is None else format(values[key], spec)
        for _, key, spec in QA_MARKDOWN_COLUMNS
    ]


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(reports: Sequence[Mapping[str, Any]]) -> str:
    """The summary rows of ``reports`` (parsed e2e JSON files) in which exact_spans ran as
    markdown: one table of strategy, ratio, minimum deviation, check share (as its server
    resolved them; ``?`` when not reported), row name (:func:`.e2e_summary.row_name`), context
    length and :data:`MARKDOWN_COLUMNS`; then, when a row has QA probes, :data:`QA_HEADING` and
    a second table with the same first columns, dataset, system and
    :data:`QA_MARKDOWN_COLUMNS`, one line per row, dataset and system
    (:func:`.qa_summary.qa_lines`). ``—`` for a missing value. Rows sorted by context length,
    row name, strategy, ratio, minimum deviation, then check share; a header line only when no
    report has such a row."""
    rows = sorted(
        (
            _with_qa(report, row)
            for report in reports
            for row in report.get("summary", [])
            if "exact_spans_hit_rate" in row
        ),
        key=_order,
    )
    settings = ["strategy", "ratio", "min dev", "check", "workload", "ctx"]
    head = [*settings, *(h for h, *_ in MARKDOWN_COLUMNS)]
    lines = [_line(head), "|" + "---|" * len(head)]
    for row in rows:
        lines.append(
            _line([*_settings(row), *(_cell(row, key, spec) for _, key, spec in MARKDOWN_COLUMNS)])
        )
    qa = [
        [*_settings(row), dataset, source, *_qa_cells(source, cell)]
        for row in rows
        for dataset, source, cell in qa_lines(row)
    ]
    if qa:
        head = [*settings, "dataset", "system", *(h for h, *_ in QA_MARKDOWN_COLUMNS)]
        lines += ["", QA_HEADING, "", _line(head), "|" + "---|" * len(head)]
        lines += [_line(cells) for cells in qa]
    return "\n".join(lines)


@click.command("table")
@click.argument(
    "reports", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
def command(reports: tuple[Path, ...]) -> None:
    """Print the exact_spans rows of e2e JSON REPORTS as one markdown table: recompute strategy
    × ratio × workload (TTFT, hits, recompute, gate declines, agreement, PPL ratio); QA rows
    add a table per dataset and system (scores cold and with reuse, McNemar p)."""
    click.echo(markdown_table([json.loads(path.read_text()) for path in reports]))
