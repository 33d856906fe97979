"""What the bench jobs report beside their measurements, and how: the machine and software
(:func:`cpu_model`, :func:`environment`), JSON files (:func:`write_json`), and the e2e job's
console table of its summary rows (:func:`console_table`, with the QA workloads' per-dataset
table :func:`qa_console_table`) headed by the recompute settings each semblend server resolved
(:func:`settings_lines`). The e2e plot is :mod:`.plot`.
"""

from __future__ import annotations

import json
import os
import platform
import textwrap
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .e2e_summary import RECOMPUTE_SETTINGS, row_name
from .qa_summary import qa_lines
from .systems import REORDER, REORDER_SPANS, SGLANG_DISPATCH

PACKAGES = ("semblend-sglang", "sglang", "torch", "transformers")
"""Distributions whose versions :func:`environment` records."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), else what
    :mod:`platform` knows (processor, else machine type)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution in ``names`` (None when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def environment(**extra: Any) -> dict[str, Any]:
    """The machine and software a measurement ran on, for a JSON report: UTC ``date``,
    ``python``, ``platform``, ``cpu`` (:func:`cpu_model`), ``cpu_count``, ``versions``
    (:data:`PACKAGES`), then ``extra`` (a job's model, flags, ...)."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "versions": package_versions(),
        **extra,
    }


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (one trailing newline) to ``path``, creating its folder;
    returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


TABLE_COLUMNS: tuple[tuple[str, int, str, str, int], ...] = (
    ("cold", 10, "cold_ms_p50", ".0f", 1),
    ("prefix", 10, "prefix_ms_p50", ".0f", 1),
    ("exact", 10, "exact_same_length_ms_p50", ".0f", 1),
    ("spans", 10, "exact_spans_ms_p50", ".0f", 1),
    ("subst", 10, "substitute_ms_p50", ".0f", 1),
    ("sp/ex", 9, "exact_spans_over_exact", ".2f", 1),
    ("speedup", 9, "exact_spans_speedup", ".1f", 1),
    ("hit%", 5, "exact_spans_hit_rate", ".0f", 100),
    ("reuse%", 6, "exact_spans_reused_fraction", ".0f", 100),
    ("ppl", 6, "exact_spans_ppl_ratio", ".3f", 1),
    ("agree", 6, "exact_spans_greedy_agreement", ".2f", 1),
    ("rougeL", 6, "exact_spans_rouge_l", ".2f", 1),
    ("ex agree", 8, "exact_greedy_agreement", ".2f", 1),
    ("kl", 7, "exact_spans_kl", ".0e", 1),
    ("ex kl", 7, "exact_kl", ".0e", 1),
    ("sub hit%", 8, "substitute_hit_rate", ".0f", 100),
    ("sub agree", 9, "substitute_greedy_agreement", ".2f", 1),
    ("miss ovh", 10, "exact_spans_miss_overhead", "+.1f", 100),
    ("hook ovh", 8, "exact_spans_miss_overhead_in_scheduler", ".3f", 100),
    ("sgl-dp", 10, f"{SGLANG_DISPATCH}_ms_p50", ".0f", 1),
    ("sgl-dp hit%", 11, f"{SGLANG_DISPATCH}_hit_rate", ".0f", 100),
    ("reorder", 10, "reorder_ms_p50", ".0f", 1),
    ("sp/ro", 9, "exact_spans_over_reorder", ".2f", 1),
    ("ro hit%", 7, "reorder_cached_fraction", ".0f", 100),
    ("ro-sp", 10, "reorder_spans_ms_p50", ".0f", 1),
    ("rs/ro", 9, "reorder_spans_over_reorder", ".2f", 1),
    ("rs speedup", 10, "reorder_spans_speedup", ".1f", 1),
    ("rs held%", 8, "reorder_spans_held_fraction", ".0f", 100),
    ("rs agree", 8, "reorder_spans_greedy_agreement", ".2f", 1),
    ("recompute", 13, "exact_spans_recompute", "s", 1),
    ("recomp%", 7, "exact_spans_recompute_share", ".0f", 100),
    ("gated", 5, "exact_spans_gate_declines", "d", 1),
    ("noise", 5, "noisy", "s", 1),
)
"""Console table columns after the row name and context length: (header, width, summary key,
format, scale: 100 shows a fraction as a percentage). ``exact_spans_recompute`` is not a
summary key: :func:`console_table` fills it with :func:`recompute_label`. A TTFT median
(``*_ms_p50``) or paired ratio with a range in the row is followed by its spread
(:func:`spread_label`)."""

NARROW_COLUMNS = frozenset(
    {"cold", "exact", "spans", "speedup", "hit%", "reuse%", "agree", "kl", "ex kl", "noise"}
)
"""The :data:`TABLE_COLUMNS` the console table shows without ``wide``: TTFT cold, exact hit and
exact_spans, the speed-up, hit and reused shares, greedy agreement with cold, SGLang's KL
measure of the hits and of the exact hit, the noise flag."""

CONSOLE_WIDTH = 120
"""Columns the legend and the noise lines of the console table are wrapped to."""

TABLE_LEGEND = (
    "TTFT median in ms over every repeat, then ±half its range (max - min) as % of the median. "
    "prefix: vanilla SGLang after the donor; exact: vanilla exact hit of the length exact_spans "
    "reused; sp/ex: spans/exact and speedup: cold/spans, medians of per-probe paired ratios "
    "(±half range, %); hit%, reuse%: server-confirmed (exact_spans); ppl: PPL ratio vs cold; "
    "agree: first-32-token greedy agreement; ex agree: the same for the exact hit (noise "
    "floor); kl, ex kl: SGLang's KL measure (its kl_test_utils) of the answer's logprobs "
    "against a cold replay of prompt + answer, mean over exact_spans' hits and over the exact "
    "hits (the floor); miss ovh: control-set TTFT vs vanilla cold, median of paired ratios, % "
    "(±half range, points); hook ovh: semblend's own time in the scheduler during a control "
    "probe, % of vanilla cold TTFT (the miss overhead's headline); sgl-dp, sgl-dp hit%: TTFT and"
    f" server-confirmed hit% of {SGLANG_DISPATCH} (exact_spans, SGLang's own DP dispatch);"
    " reorder: vanilla SGLang sent the probe with its passages in a donor's order (the lossless"
    " anchor), sp/ro: spans/reorder, median of paired ratios, ro hit%: its exact prefix hit, %"
    " of the prompt; ro-sp: reorder_spans, semblend sent the probe as it is with its passages"
    " declared (the server orders them), rs/ro: reorder_spans/reorder and rs speedup:"
    " cold/reorder_spans, medians of paired ratios, rs held%: its exact prefix plus semblend's"
    " reuse, % of the prompt, rs agree: its greedy agreement with cold of the original order;"
    " recompute: the recompute strategy and ratio exact_spans' server resolved (? when it did"
    " not report them); recomp%: reused positions it recomputed, % of reused + recomputed;"
    " gated: probes its quality gate declined; noise: ! when the row's spread is large or"
    " another process took CPU while it ran (why: below the table), else ok."
)


QA_SOURCE_LABELS: dict[str, str] = {
    "cold": "cold",
    "exact_same_length": "exact",
    "exact_spans": "spans",
    "substitute": "subst",
    SGLANG_DISPATCH: "sgl-dp",
    REORDER: "reorder",
    REORDER_SPANS: "ro-sp",
}
"""How the console's QA table names each :data:`.qa_summary.QA_SOURCES` source."""

QA_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("n", "n", "s"),
    ("cold acc", "cold_accuracy", ".2f"),
    ("cold EM", "cold_em", ".2f"),
    ("cold F1", "cold_f1", ".2f"),
    ("cold R-L", "cold_rouge_l", ".2f"),
    ("acc", "accuracy", ".2f"),
    ("EM", "em", ".2f"),
    ("F1", "f1", ".2f"),
    ("R-L", "rouge_l", ".2f"),
    ("=cold", "agreement", ".2f"),
    ("agree", "greedy_agreement", ".2f"),
    ("kl", "kl", ".0e"),
    ("b/c", "b_c", "s"),
    ("p", "mcnemar_p", ".3g"),
)
"""The QA table's columns after workload, context length, dataset and system: (header, key of
:func:`qa_cell_values`, format); :mod:`.e2e_table` uses the same keys."""

QA_TABLE_LEGEND = (
    "QA, each dataset on its own (first repeat): n: probes scored, with (k) when only k of "
    "them have vanilla's cold run (the cold and paired columns are over those k); acc: yes/no "
    "and number answers right; EM, F1: SQuAD exact match and token F1 of span answers; R-L: "
    "ROUGE-L of summaries against their reference; cold acc/EM/F1/R-L: the same for the cold "
    "run; =cold: answers (normalized) equal to cold's; agree: first-32-token greedy agreement "
    "with cold; kl: SGLang's KL measure against the cold replay (the cold line's: its own "
    "decode against its prefill); b/c: probes right cold and wrong here / wrong cold and "
    "right here (right: yes/no or number correct or exact match; summaries are not counted); "
    "p: exact two-sided McNemar p-value of b and c."
)


def qa_cell_values(source: str, cell: Mapping[str, Any]) -> dict[str, Any]:
    """One QA table line's values (keys of :data:`QA_COLUMNS`) from a
    :func:`.qa_summary.qa_columns` cell of ``source``: ``n`` as ``"n"``, or ``"n (k)"`` when
    only ``k`` of its probes have a cold run; ``b_c`` as ``"b/c"``. A ``cold`` cell (no other
    source ran) fills the cold columns and leaves the others None."""
    if source == "cold":
        return {
            "n": str(cell["n"]),
            "cold_accuracy": cell.get("accuracy"),
            "cold_em": cell.get("em"),
            "cold_f1": cell.get("f1"),
            "cold_rouge_l": cell.get("rouge_l"),
            "kl": cell.get("kl"),
        }
    n, paired = cell["n"], cell.get("paired", 0)
    return {
        **{key: cell.get(key) for _, key, _ in QA_COLUMNS},
        "n": str(n) if paired == n else f"{n} ({paired})",
        "b_c": f"{cell.get('b', 0)}/{cell.get('c', 0)}" if paired else None,
        "mcnemar_p": cell.get("mcnemar_p") if paired else None,
    }


def qa_console_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The QA lines of the console report: one per row, dataset and system
    (:func:`.qa_summary.qa_lines`) with :data:`QA_COLUMNS`, then :data:`QA_TABLE_LEGEND`;
    empty when no row has QA cells."""
    head = ["workload", "ctx", "dataset", "system", *(h for h, _, _ in QA_COLUMNS)]
    body: list[list[str]] = []
    for row in rows:
        for dataset, source, cell in qa_lines(row):
            values = qa_cell_values(source, cell)
            body.append(
                [
                    row_name(row),
                    str(row["context_tokens"]),
                    dataset,
                    QA_SOURCE_LABELS.get(source, source),
                    *(_cell(values.get(key), spec, 1) for _, key, spec in QA_COLUMNS),
                ]
            )
    if not body:
        return []
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]

    def fmt(cells: Sequence[str]) -> str:
        left = [f"{c:{w}s}" for c, w in zip(cells[:4], widths[:4], strict=True)]
        right = [f"{c:>{w}s}" for c, w in zip(cells[4:], widths[4:], strict=True)]
        return " ".join(left + right)

    lines = [fmt(head)]
    lines.append("-" * len(lines[0]))
    lines += [fmt(line) for line in body]
    return [*lines, QA_TABLE_LEGEND]


def spread_label(row: Mapping[str, Any], key: str) -> str:
    """The spread that follows ``key``'s median in a table cell: ``±N%`` (half the range as a
    share of the median) for a TTFT median (``*_ms_p50`` with ``*_ms_min``/``*_ms_max``) or a
    paired ratio (``key_min``/``key_max``); ``±N`` percentage points for an overhead
    (``*_miss_overhead``); empty when the row has no range for ``key``."""
    base = key[: -len("_p50")] if key.endswith("_ms_p50") else key
    lo, hi, mid = row.get(f"{base}_min"), row.get(f"{base}_max"), row.get(key)
    if lo is None or hi is None or mid is None:
        return ""
    if key.endswith("_miss_overhead"):
        return f"±{50 * (hi - lo):.0f}"
    return f"±{50 * (hi - lo) / mid:.0f}%" if mid > 0 else ""


def recompute_label(row: Mapping[str, Any], system: str = "exact_spans") -> str | None:
    """``system``'s resolved recompute strategy and ratio in ``row`` as one short cell, e.g.
    ``deviation 15%``; ``?`` for a part the server did not report (an older server); None when
    ``system`` did not run in the row (no ``{system}_recompute_strategy`` key)."""
    if f"{system}_recompute_strategy" not in row:
        return None
    strategy = row.get(f"{system}_recompute_strategy")
    return f"{strategy or '?'} {ratio_label(row.get(f'{system}_recompute_ratio'))}"


def ratio_label(ratio: float | None) -> str:
    """A recompute ratio as a percentage without trailing zeros (0.05 -> ``5%``, 0.125 ->
    ``12.5%``); ``?`` for None (not reported)."""
    return "?" if ratio is None else f"{100 * float(ratio):g}%"


def settings_lines(configs: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """One line per semblend system in ``configs`` (system -> the settings its server resolved,
    :attr:`.e2e_runner.Runner.configs`) naming its :data:`.e2e_summary.RECOMPUTE_SETTINGS`, e.g.
    ``exact_spans: recompute_strategy=heads recompute_ratio=0.05 ...``; a setting the server did
    not report shows as ``?``; a server that reported no config (older than the snapshot's
    ``config``) gets ``{system}: settings not reported``."""
    lines: list[str] = []
    for system, config in configs.items():
        if config is None:
            lines.append(f"{system}: settings not reported")
            continue
        values = " ".join(
            f"{k}={'?' if config.get(k) is None else config[k]}" for k in RECOMPUTE_SETTINGS
        )
        lines.append(f"{system}: {values}")
    return lines


def _cell(value: Any, spec: str, scale: int) -> str:
    """``value`` (times ``scale``) formatted with ``spec`` when a float, ``-`` when None, ``!``
    for True and ``ok`` for False (the noise flag), else ``str``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "!" if value else "ok"
    if scale != 1:
        value = scale * value
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def console_table(rows: Sequence[dict[str, Any]], wide: bool = False) -> str:
    """The e2e summary rows (:func:`.e2e_summary.summarize`) as a fixed-width text table: one
    line per row, named by :func:`.e2e_summary.row_name`, with :data:`NARROW_COLUMNS` (every
    one of :data:`TABLE_COLUMNS` when ``wide``), then :data:`TABLE_LEGEND`, then one line per
    noisy row saying why (both wrapped to :data:`CONSOLE_WIDTH`); when a row has QA probes, a
    blank line and :func:`qa_console_table`. A cell with no value shows ``-``."""
    columns = tuple(c for c in TABLE_COLUMNS if wide or c[0] in NARROW_COLUMNS)
    width = max([18, *(len(row_name(r)) for r in rows)])
    head = f"{'workload':{width}s} {'ctx':>5s}" + "".join(
        f" {title:>{w}s}" for title, w, *_ in columns
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        r = {**row, "exact_spans_recompute": recompute_label(row)}
        cells = "".join(
            f" {_cell(r.get(key), spec, scale) + spread_label(r, key):>{w}s}"
            for _, w, key, spec, scale in columns
        )
        lines.append(f"{row_name(r):{width}s} {r['context_tokens']:5d}{cells}")
    lines += textwrap.wrap(TABLE_LEGEND, CONSOLE_WIDTH)
    for row in rows:
        if row.get("noisy"):
            why = f"noisy: {row_name(row)} {row['context_tokens']}: {row['noisy_why']}"
            lines += textwrap.wrap(why, CONSOLE_WIDTH, subsequent_indent="  ")
    qa = qa_console_table(rows)
    if qa:
        lines += ["", *qa]
    return "\n".join(lines)
