"""``bench table E2E.json ...``: the exact_spans rows of several e2e reports as one markdown
table, one line per report and row, sorted so that each workload's recompute strategies and
ratios sit together (docs/perf.md's strategy × ratio × workload table: one e2e run per setting,
e.g. ``--semblend-env SEMBLEND_RECOMPUTE_STRATEGY=heads --semblend-env
SEMBLEND_RECOMPUTE_RATIO=0.05``). Strategy and ratio are what each run's server resolved (the
rows' ``exact_spans_recompute_strategy`` and ``_ratio``, JSON schema 4 and later); a report
without them (schema 3) shows ``?``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from .e2e_summary import row_name
from .report import ratio_label

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
)
"""Columns after strategy, ratio, workload and context length: (header, summary key, format).
TTFT p50 in ms; ``spans / exact`` and ``speed-up``: medians of per-probe paired ratios;
``recomputed``: share of reused + recomputed tokens; ``cold margin at
divergence``: median over the hits that part from cold of the cold run's top-1 / top-2 logprob
margin where they part (``—``: none parts; ``?``: some part, but the report has no margins)."""

QA_MARKDOWN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("QA probes", "qa_probes", "d"),
    ("accuracy cold", "cold_accuracy", ".2f"),
    ("accuracy exact_spans", "exact_spans_accuracy", ".2f"),
    ("F1 cold", "cold_f1", ".2f"),
    ("F1 exact_spans", "exact_spans_f1", ".2f"),
)
"""Columns added after :data:`MARKDOWN_COLUMNS` when a row has probes with gold answers (the QA
workloads, schema 8): answers scored against them, cold and on exact_spans (``—`` in rows
without)."""


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


def markdown_table(reports: Sequence[Mapping[str, Any]]) -> str:
    """One markdown table of the summary rows of ``reports`` (parsed e2e JSON files) in which
    exact_spans ran: strategy, ratio, minimum deviation, check share (as its server resolved
    them; ``?`` when not reported),
    row name (:func:`.e2e_summary.row_name`), context length, then :data:`MARKDOWN_COLUMNS`
    and, when a row has QA probes, :data:`QA_MARKDOWN_COLUMNS` (``—`` for a missing value).
    Sorted by context length, row name, strategy, ratio, minimum deviation, then check share;
    a header line only when no report has such a row."""
    rows = [
        row
        for report in reports
        for row in report.get("summary", [])
        if "exact_spans_hit_rate" in row
    ]

    def order(row: Mapping[str, Any]) -> tuple[Any, ...]:
        ratio = row.get("exact_spans_recompute_ratio")
        strategy = row.get("exact_spans_recompute_strategy") or ""
        floor = row.get("exact_spans_recompute_min_deviation") or 0.0
        share = row.get("exact_spans_recompute_check_share") or 0.0
        return (
            row["context_tokens"],
            row_name(row),
            strategy,
            ratio is None,
            ratio or 0.0,
            floor,
            share,
        )

    columns = MARKDOWN_COLUMNS
    if any(row.get("qa_probes") for row in rows):
        columns += QA_MARKDOWN_COLUMNS
    head = ["strategy", "ratio", "min dev", "check", "workload", "ctx", *(h for h, *_ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in sorted(rows, key=order):
        cells = [
            row.get("exact_spans_recompute_strategy") or "?",
            ratio_label(row.get("exact_spans_recompute_ratio")),
            _floor_label(row.get("exact_spans_recompute_min_deviation")),
            _share_label(row.get("exact_spans_recompute_check_share")),
            row_name(row),
            str(row["context_tokens"]),
            *(_cell(row, key, spec) for _, key, spec in columns),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command("table")
@click.argument(
    "reports", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
def command(reports: tuple[Path, ...]) -> None:
    """Print the exact_spans rows of e2e JSON REPORTS as one markdown table: recompute strategy
    × ratio × workload (TTFT, hits, recompute, gate declines, agreement, PPL ratio)."""
    click.echo(markdown_table([json.loads(path.read_text()) for path in reports]))
