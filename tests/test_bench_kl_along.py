"""Where along a reused answer KL rises (``bench kl-along``), on hand-made records whose KL
terms are known; the quick e2e run (tests/test_bench_e2e.py) runs it on real records."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from semblend_sglang.bench.e2e_runner import ProbeRecord
from semblend_sglang.bench.kl_along import kl_along, kl_cases, table
from semblend_sglang.bench.metrics import kl_divergence, kl_terms


def _rec(
    system: str,
    kind: str,
    ids: list[int],
    *,
    group: str = "g",
    outcome: str | None = None,
    repeat: int = 0,
    drift: list[float] | None = None,
    margins: list[float] | None = None,
) -> ProbeRecord:
    """Probe 0 of ``group``; with ``drift``, its replay logprobs sit ``drift`` above its own."""
    own = [-1.0] * len(ids)
    return ProbeRecord(
        "news_summary",
        2048,
        group,
        0,
        system,
        kind,
        1.0,
        2000,
        0,
        outcome=outcome,
        output_ids=ids,
        output_logprobs=own if drift is not None else [],
        replay_logprobs=[o + d for o, d in zip(own, drift, strict=True)] if drift else [],
        margins=margins or [],
        reused_tokens=1900 if outcome else None,
        recomputed_tokens=3 if outcome else None,
        donors=1,
        repeat=repeat,
    )


def _term(d: float) -> float:
    return math.expm1(d) - d


def test_kl_terms_are_sglangs_per_token_terms_and_their_mean_is_the_kl() -> None:
    out, replay = [-1.0, -2.0, -0.5], [-1.0, -1.8, -0.9]
    terms = kl_terms(out, replay)
    assert terms == pytest.approx([0.0, _term(0.2), _term(-0.4)])
    assert kl_divergence(out, replay) == pytest.approx(sum(terms) / 3)
    with pytest.raises(ValueError, match="2 output vs 3 replay"):
        kl_terms(out[:2], replay)


def test_terms_are_read_before_at_and_after_the_first_divergence_from_cold() -> None:
    reused = _rec(
        "exact_spans", "semantic", [1, 2, 3, 4, 5], outcome="materialized",
        drift=[0.3, 0.1, 0.2, 0.0, 0.4],
    )  # fmt: skip
    cold = _rec("vanilla", "cold", [1, 2, 9, 4, 5], margins=[0.5, 0.4, 0.01, 0.3, 0.2])
    case = kl_along(reused, cold)
    assert case is not None
    assert case.divergence == 2
    assert case.before == pytest.approx((_term(0.3) + _term(0.1)) / 2)
    assert case.at == pytest.approx(_term(0.2))
    assert case.after == pytest.approx((_term(0.0) + _term(0.4)) / 2)
    assert case.cold_margin == 0.01
    assert (case.peak, case.peak_at) == (pytest.approx(_term(0.4)), 4)
    assert case.kl == pytest.approx(reused.kl)
    assert (case.reused, case.recomputed) == (1900, 3)


def test_an_answer_equal_to_cold_has_no_divergence_and_every_term_before() -> None:
    reused = _rec("exact_spans", "semantic", [1, 2], outcome="materialized", drift=[0.1, 0.2])
    case = kl_along(reused, _rec("vanilla", "cold", [1, 2], margins=[1.0, 1.0]))
    assert case is not None and case.divergence is None
    assert case.before == pytest.approx(case.kl)
    assert case.at is None and case.after is None and case.cold_margin is None


def test_only_first_repeat_materialized_probes_with_a_cold_run_and_a_replay_are_cases() -> None:
    drift = [0.1, 0.0]
    records = [
        _rec("exact_spans", "semantic", [1, 2], group="a", outcome="materialized", drift=drift),
        _rec("vanilla", "cold", [1, 3], group="a"),
        _rec("exact_spans", "semantic", [1, 2], group="b", outcome="missed", drift=drift),
        _rec("vanilla", "cold", [1, 2], group="b"),
        _rec("exact_spans", "semantic", [1, 2], group="c", outcome="materialized", drift=drift),
        _rec("exact_spans", "semantic", [1, 2], group="d", outcome="materialized", drift=drift),
        _rec("vanilla", "cold", [1, 2], group="d", repeat=1),
        _rec("exact_spans", "semantic", [1, 2], group="e", outcome="materialized"),
        _rec("vanilla", "cold", [1, 2], group="e"),
    ]
    (case,) = kl_cases(records)
    assert case.group_id == "a" and case.divergence == 1
    assert kl_cases(records, "substitute") == []


def test_the_table_has_a_row_per_case_and_the_means_of_the_diverging_ones(tmp_path: Path) -> None:
    records = [
        _rec("exact_spans", "semantic", [1, 2], group="a", outcome="materialized",
             drift=[0.2, 0.0]),
        _rec("vanilla", "cold", [1, 3], group="a", margins=[0.5, 0.02]),
        _rec("exact_spans", "semantic", [1, 2], group="b", outcome="materialized",
             drift=[0.1, 0.1]),
        _rec("vanilla", "cold", [1, 2], group="b", margins=[0.5, 0.5]),
    ]  # fmt: skip
    text = table(kl_cases(records))
    rows = text.splitlines()
    assert len(rows) == 2 + 2 + 1
    assert rows[2].startswith("| a | ") and "| 1 |" in rows[2]
    assert rows[3].startswith("| b | ") and "| — |" in rows[3]
    assert rows[4].startswith("| mean of 1 diverging |") and "0.020" in rows[4]
    path = tmp_path / "e2e.records.jsonl"
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    done = subprocess.run(
        [sys.executable, "-m", "semblend_sglang.bench", "kl-along", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == text
    none = subprocess.run(
        [sys.executable, "-m", "semblend_sglang.bench", "kl-along", str(path), "--system", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert none.returncode != 0 and "no x probe that reused KV" in none.stderr
