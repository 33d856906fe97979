"""What the bench jobs report beside their measurements, and how: the machine and software
(:func:`cpu_model`, :func:`environment`), JSON files (:func:`write_json`), and the e2e job's
console table of its summary rows (:func:`console_table`). The e2e plot is :mod:`.plot`.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .systems import SGLANG_DISPATCH

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


def _fmt(value: Any, spec: str = ".0f") -> str:
    """``value`` formatted with ``spec`` when a float, ``-`` when None, else ``str``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def console_table(rows: Sequence[dict[str, Any]]) -> str:
    """The e2e summary rows (:func:`.e2e_summary.summarize`) as a fixed-width text table, one
    line per row, then a legend."""
    head = (
        f"{'workload':18s} {'ctx':>5s} {'cold':>7s} {'prefix':>7s} {'exact':>7s} {'spans':>7s}"
        f" {'subst':>7s} {'sp/ex':>6s} {'hit%':>5s} {'reuse%':>6s} {'ppl':>6s} {'agree':>6s}"
        f" {'rougeL':>6s} {'ex agree':>8s} {'sub hit%':>8s} {'sub agree':>9s} {'miss ovh':>8s}"
        f" {'hook ovh':>8s} {'sgl-dp':>7s} {'sgl-dp hit%':>11s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        hit = r.get("exact_spans_hit_rate")
        reuse = r.get("exact_spans_reused_fraction")
        sub_hit = r.get("substitute_hit_rate")
        miss = r.get("exact_spans_miss_overhead")
        hook = r.get("exact_spans_miss_overhead_in_scheduler")
        dp_hit = r.get(f"{SGLANG_DISPATCH}_hit_rate")
        lines.append(
            f"{r['workload']:18s} {r['context_tokens']:5d} {_fmt(r.get('cold_ms_p50')):>7s}"
            f" {_fmt(r.get('prefix_ms_p50')):>7s} {_fmt(r.get('exact_same_length_ms_p50')):>7s}"
            f" {_fmt(r.get('exact_spans_ms_p50')):>7s} {_fmt(r.get('substitute_ms_p50')):>7s}"
            f" {_fmt(r.get('exact_spans_over_exact'), '.2f'):>6s}"
            f" {_fmt(None if hit is None else 100 * hit):>5s}"
            f" {_fmt(None if reuse is None else 100 * reuse):>6s}"
            f" {_fmt(r.get('exact_spans_ppl_ratio'), '.3f'):>6s}"
            f" {_fmt(r.get('exact_spans_greedy_agreement'), '.2f'):>6s}"
            f" {_fmt(r.get('exact_spans_rouge_l'), '.2f'):>6s}"
            f" {_fmt(r.get('exact_greedy_agreement'), '.2f'):>8s}"
            f" {_fmt(None if sub_hit is None else 100 * sub_hit):>8s}"
            f" {_fmt(r.get('substitute_greedy_agreement'), '.2f'):>9s}"
            f" {_fmt(None if miss is None else 100 * miss, '+.1f'):>8s}"
            f" {_fmt(None if hook is None else 100 * hook, '.3f'):>8s}"
            f" {_fmt(r.get(f'{SGLANG_DISPATCH}_ms_p50')):>7s}"
            f" {_fmt(None if dp_hit is None else 100 * dp_hit):>11s}"
        )
    lines.append(
        "TTFT p50 in ms. prefix: vanilla SGLang after the donor; exact: vanilla exact hit of the "
        "length exact_spans reused; sp/ex: spans/exact; hit%, reuse%: server-confirmed "
        "(exact_spans); ppl: PPL ratio vs cold; agree: first-32-token greedy agreement; "
        "ex agree: the same for the exact hit (noise floor); miss ovh:"
        " control-set TTFT vs vanilla cold, %; hook ovh: semblend's own time in the scheduler"
        " during a control probe, % of vanilla cold TTFT; sgl-dp, sgl-dp hit%: TTFT and"
        f" server-confirmed hit% of {SGLANG_DISPATCH} (exact_spans, SGLang's own DP dispatch)."
    )
    return "\n".join(lines)
