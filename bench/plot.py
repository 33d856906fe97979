"""The e2e job's figure (PNG) of its summary rows: TTFT per row and system, and quality against
the cold run.

A row is a workload (or, for a ``--workload`` file, a workload's label: :func:`.e2e_summary.
row_name`). With one context length the TTFT panel draws grouped bars: one group per row, one bar
per system and kind (:data:`TTFT_SERIES`). With several lengths it draws one small panel per row,
TTFT against context length, one line per system and kind; nothing is averaged over rows.

The quality panel draws grouped bars per row (:data:`QUALITY_SERIES`: quality of the probes
that had a hit; rows with donors only, averaged over context lengths where the system had
hits). A cell whose system ran but had no server-confirmed hit is marked "no hit" (a short
hatched stub) instead of drawing its quality: without reuse the answer is the cold run's own and
would read as a perfect 1.0.

:func:`ttft_bars`, :func:`ttft_lines` and :func:`quality_bars` compute what is drawn;
:func:`figure` draws it; :func:`plot` writes the PNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .e2e_summary import row_name
from .metrics import mean_or_none
from .systems import SGLANG_DISPATCH

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

TTFT_SERIES: tuple[tuple[str, str], ...] = (
    ("cold_ms_p50", "cold (vanilla)"),
    ("prefix_ms_p50", "vanilla, donor cached"),
    ("exact_same_length_ms_p50", "exact hit, same length"),
    ("exact_spans_ms_p50", "semblend exact_spans"),
    ("substitute_ms_p50", "semblend substitute"),
    (f"{SGLANG_DISPATCH}_ms_p50", "exact_spans, SGLang's DP dispatch"),
)
"""(summary key, legend) of the TTFT series, drawn when a row has a value."""
QUALITY_SERIES: tuple[tuple[str, str, str], ...] = (
    ("exact_spans", "greedy_agreement_hits", "exact_spans: greedy agreement"),
    ("exact_spans", "rouge_l_hits", "exact_spans: ROUGE-L"),
    ("substitute", "greedy_agreement_hits", "substitute: greedy agreement"),
)
"""(system, summary metric, legend) of the quality series, drawn when the system ran: quality
over the probes with a server-confirmed hit (a miss would count the cold run's own answer)."""
NO_HIT = "no hit"
NO_HIT_HEIGHT = 0.06
"""Height of the hatched stub that marks a no-hit cell (quality is in [0, 1])."""


@dataclass(frozen=True)
class BarChart:
    """Grouped bars: ``values[s][c]`` of series ``s`` in category ``c`` (None: no bar);
    ``no_hit`` holds the (series, category) cells marked "no hit" instead of a bar."""

    categories: tuple[str, ...]
    series: tuple[str, ...]
    values: tuple[tuple[float | None, ...], ...]
    no_hit: frozenset[tuple[int, int]] = frozenset()


def _names(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(row_name(r) for r in rows))


def ttft_bars(rows: Sequence[dict[str, Any]]) -> BarChart:
    """TTFT p50 (ms) per row (one context length) and :data:`TTFT_SERIES` entry that has a
    value in some row."""
    names = _names(rows)
    by_name = {row_name(r): r for r in rows}
    series = [(k, label) for k, label in TTFT_SERIES if any(r.get(k) is not None for r in rows)]
    return BarChart(
        categories=tuple(names),
        series=tuple(label for _, label in series),
        values=tuple(tuple(by_name[n].get(k) for n in names) for k, _ in series),
    )


def ttft_lines(
    rows: Sequence[dict[str, Any]],
) -> dict[str, list[tuple[str, list[int], list[float]]]]:
    """Per row name: (legend, context lengths, TTFT p50 ms) of each :data:`TTFT_SERIES` entry
    with a value at some length of that row."""
    out: dict[str, list[tuple[str, list[int], list[float]]]] = {}
    for name in _names(rows):
        mine = sorted((r for r in rows if row_name(r) == name), key=lambda r: r["context_tokens"])
        lines = []
        for key, label in TTFT_SERIES:
            points = [(r["context_tokens"], r[key]) for r in mine if r.get(key) is not None]
            if points:
                lines.append((label, [x for x, _ in points], [y for _, y in points]))
        out[name] = lines
    return out


def quality_bars(rows: Sequence[dict[str, Any]]) -> BarChart:
    """Quality vs cold per row name with donors and :data:`QUALITY_SERIES` entry whose system
    ran: the mean over the name's rows (context lengths) where the system had hits; a cell whose
    system ran in that row name without any hit is in ``no_hit`` and has no value."""
    rows = [r for r in rows if not r.get("control")]
    names = _names(rows)
    series = [s for s in QUALITY_SERIES if any(f"{s[0]}_hit_rate" in r for r in rows)]
    values: list[tuple[float | None, ...]] = []
    no_hit: set[tuple[int, int]] = set()
    for s, (system, metric, _) in enumerate(series):
        cells: list[float | None] = []
        for c, name in enumerate(names):
            ran = [r for r in rows if row_name(r) == name and f"{system}_hit_rate" in r]
            hit = [r for r in ran if r[f"{system}_hit_rate"] > 0]
            got = [r[f"{system}_{metric}"] for r in hit if r.get(f"{system}_{metric}") is not None]
            if ran and not hit:
                no_hit.add((s, c))
            cells.append(mean_or_none(got))
        values.append(tuple(cells))
    return BarChart(
        categories=tuple(names),
        series=tuple(label for *_, label in series),
        values=tuple(values),
        no_hit=frozenset(no_hit),
    )


def bar_x(chart: BarChart, series: int, category: int) -> float:
    """The x position of a bar (groups at 0, 1, ...; bars side by side, 0.8 wide in all)."""
    width = 0.8 / max(1, len(chart.series))
    return category + (series - (len(chart.series) - 1) / 2) * width


def _color(label: str) -> str:
    """One color per series legend across all panels: ``C0``, ``C1``, ... (the color cycle) in
    the order of :data:`TTFT_SERIES` then :data:`QUALITY_SERIES`."""
    legends = [label for _, label in TTFT_SERIES] + [label for *_, label in QUALITY_SERIES]
    return f"C{legends.index(label) % 10}"


def _draw_bars(ax: Axes, chart: BarChart) -> None:
    width = 0.8 / max(1, len(chart.series))
    for s, label in enumerate(chart.series):
        color = _color(label)
        drawn = [(bar_x(chart, s, c), v) for c, v in enumerate(chart.values[s]) if v is not None]
        ax.bar([x for x, _ in drawn], [v for _, v in drawn], width, color=color, label=label)
        for c in sorted(c for t, c in chart.no_hit if t == s):
            x = bar_x(chart, s, c)
            ax.bar(
                x,
                NO_HIT_HEIGHT,
                width,
                fill=False,
                hatch="///",
                edgecolor=color,
                label=f"_{NO_HIT}",
                gid=NO_HIT,
            )
            ax.text(x, NO_HIT_HEIGHT + 0.01, NO_HIT, rotation=90, ha="center", va="bottom")
    ax.set_xticks(range(len(chart.categories)), chart.categories, rotation=15)
    if chart.series:
        ax.legend(fontsize=8)


def _draw_quality(ax: Axes, rows: Sequence[dict[str, Any]]) -> None:
    chart = quality_bars(rows)
    _draw_bars(ax, chart)
    ax.set_ylim(0, 1.1)
    ax.set_title("Quality vs cold (1.0 = identical; hatched: no hit)")
    if not chart.categories:
        ax.text(0.5, 0.5, "no row with donors", ha="center", transform=ax.transAxes)


def figure(rows: Sequence[dict[str, Any]]) -> Figure:
    """The figure of the module doc: ``[TTFT bars, quality]`` axes with one context length,
    ``[one TTFT panel per row name..., quality]`` (then hidden spare axes) with several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len({r["context_tokens"] for r in rows}) <= 1:
        bars = ttft_bars(rows)
        width = max(13.0, 3.0 + 1.6 * len(bars.categories))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(width, 5.0), squeeze=True)
        _draw_bars(ax1, bars)
        ctx = rows[0]["context_tokens"] if rows else 0
        ax1.set_ylabel("TTFT p50 (ms)")
        ax1.set_title(f"Time to first token, {ctx} context tokens")
        _draw_quality(ax2, rows)
        fig.tight_layout()
        return fig
    panels = ttft_lines(rows)
    ncols = min(4, len(panels) + 1)
    nrows = math.ceil((len(panels) + 1) / ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
    axes = list(grid.flat)
    handles: dict[str, Any] = {}
    for ax, (name, lines) in zip(axes, panels.items(), strict=False):
        for label, xs, ys in lines:
            (handles[label],) = ax.plot(xs, ys, marker="o", color=_color(label), label=label)
        ax.set_title(f"TTFT p50 (ms): {name}", fontsize=9)
        ax.set_xlabel("context tokens")
    _draw_quality(axes[len(panels)], rows)
    spare = axes[len(panels) + 1 :]
    for ax in spare:
        ax.set_visible(False)
    legend_ax = spare[0] if spare else axes[0]
    legend_ax.legend(list(handles.values()), list(handles), fontsize=8, loc="upper left")
    if spare:  # the legend alone in the first spare cell
        legend_ax.set_visible(True)
        legend_ax.axis("off")
    fig.tight_layout()
    return fig


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write :func:`figure` of the summary ``rows`` as a PNG at ``path`` (folder created)."""
    fig = figure(rows)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
