"""The quality gate / post-hoc guard evaluation over e2e records (``bench gate``)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from semblend_sglang.bench.e2e_runner import ProbeRecord
from semblend_sglang.bench.gate_eval import (
    evaluate,
    flags,
    gate_cases,
    rank_auc,
    read_records,
    share_thresholds,
    table,
)
from semblend_sglang.bench.workloads import GoldAnswer

YES = GoldAnswer("yes_no", ("yes",), "boolq")
NORMAN = GoldAnswer("span", ("Afranji",), "disflqa")  # "... what was the Norman castle called ?"


def _pair(
    group: str,
    cold_text: str,
    reused_text: str,
    *,
    residual: float | None,
    margin: float | None,
    cold_ttft: float = 4.0,
    reused_ttft: float = 1.0,
    outcome: str = "materialized",
    gold: GoldAnswer | None = YES,
) -> list[ProbeRecord]:
    def rec(system: str, kind: str, text: str, ttft: float, **kw: object) -> ProbeRecord:
        return ProbeRecord(
            workload="qa_rag",
            context_tokens=512,
            group_id=group,
            probe=0,
            system=system,
            kind=kind,
            ttft_s=ttft,
            prompt_tokens=500,
            cached_tokens=0,
            output_ids=[ord(c) for c in text],
            text=text,
            donors=1,
            gold=gold,
            **kw,  # type: ignore[arg-type]
        )

    return [
        rec(
            "exact_spans",
            "semantic",
            reused_text,
            reused_ttft,
            outcome=outcome,
            residual_deviation=residual,
            margins=[] if margin is None else [margin, 3.0],
        ),
        rec("vanilla", "prefix", "Yes", 3.0),
        rec("vanilla", "cold", cold_text, cold_ttft, margins=[2.0, 3.0]),
    ]


def _records() -> list[ProbeRecord]:
    """Four hits: two lost (cold right, reused wrong), one kept, one gained; one decline."""
    return [
        *_pair("g0", "Yes", "No", residual=0.9, margin=0.1),  # lost, riskiest on both
        *_pair("g1", "Yes", "No!", residual=0.2, margin=2.5),  # lost, looks safe
        *_pair("g2", "Yes", "Yes", residual=0.1, margin=2.0),  # kept
        *_pair("g3", "No", "Yes", residual=0.5, margin=0.2),  # gained
        *_pair("g4", "Yes", "No", residual=None, margin=None, outcome="declined:no_donor"),
    ]


def test_cases_pair_each_hit_with_its_cold_run_and_skip_declines() -> None:
    cases = gate_cases(_records())
    assert [c.residual for c in cases] == [0.9, 0.2, 0.1, 0.5]  # g4 declined: ran dense
    assert [c.lost for c in cases] == [True, True, False, False]
    assert [c.changed for c in cases] == [True, True, False, True]
    assert cases[0].first_margin == 0.1 and cases[0].cold_ttft_s == 4.0


def test_gate_off_and_gate_everything_bound_the_table() -> None:
    cases = gate_cases(_records())
    off = evaluate(cases, "residual", None)
    assert (off.flagged, off.lost, off.lost_caught) == (0, 2, 0)
    assert off.accuracy == {"boolq": 2 / 4}  # the reused answers: g2, g3 right
    assert off.speedup == pytest.approx(16 / 4)
    everything = evaluate(cases, "residual", 0.0)
    assert everything.flagged == 4 and everything.recall == 1.0
    assert everything.accuracy == {"boolq": 3 / 4}  # cold's answers
    assert everything.speedup == pytest.approx(1.0)  # the gate pays one dense forward
    guard = evaluate(cases, "first_margin", 10.0)
    assert guard.flagged == 4 and guard.speedup == pytest.approx(16 / 20)  # reused + dense


def test_precision_recall_and_the_modelled_cost_at_a_threshold() -> None:
    cases = gate_cases(_records())
    p = evaluate(cases, "residual", 0.3)  # flags g0 (lost) and g3 (gained)
    assert (p.flagged, p.lost_caught, p.changed_caught) == (2, 1, 2)
    assert p.precision == 0.5 and p.recall == 0.5
    assert p.accuracy == {"boolq": 2 / 4}  # g0 now right, g3 now wrong
    assert p.speedup == pytest.approx(16 / (4 + 1 + 1 + 4))
    m = evaluate(cases, "first_margin", 1.0)  # low margins: g0 and g3 again
    assert (m.flagged, m.lost_caught) == (2, 1)
    assert m.speedup == pytest.approx(16 / (5 + 1 + 1 + 5))


def test_flags_point_the_right_way_and_ignore_missing_signals() -> None:
    case = gate_cases(_records())[0]
    assert flags(case, "residual", 0.5) and not flags(case, "residual", 0.95)
    assert flags(case, "first_margin", 0.5) and not flags(case, "first_margin", 0.05)
    assert not flags(case, "residual", None)
    blank = gate_cases(_pair("g", "Yes", "No", residual=None, margin=None))[0]
    assert not flags(blank, "residual", 0.0) and not flags(blank, "first_margin", 9.0)
    with pytest.raises(ValueError, match="unknown signal"):
        flags(case, "entropy", 1.0)


def test_share_thresholds_flag_the_riskiest_share_exactly() -> None:
    cases = gate_cases(_records())
    for signal in ("residual", "first_margin"):
        cuts = share_thresholds(cases, signal, (0.25, 0.5, 1.0))
        assert [evaluate(cases, signal, t).flagged for t in cuts] == [1, 2]  # 100%: no cut


def test_rank_auc_orders_lost_cases_against_the_rest() -> None:
    cases = gate_cases(_records())
    # lost residuals 0.9, 0.2 against kept 0.1, 0.5: 0.9 beats both, 0.2 beats 0.1
    assert rank_auc(cases, "residual") == pytest.approx(3 / 4)
    assert rank_auc(cases, "first_margin") == pytest.approx(2 / 4)  # 0.1 beats both, 2.5 none
    no_gold = gate_cases(_pair("g", "x", "y", residual=0.1, margin=1.0, gold=None))
    assert rank_auc(no_gold, "residual") is None  # nothing lost without a gold answer
    with pytest.raises(ValueError, match="no cases"):
        evaluate([], "residual", None)


def test_the_gate_job_reads_a_records_file(tmp_path: Path) -> None:
    path = tmp_path / "run.records.jsonl"
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in _records()))
    assert [c.residual for c in gate_cases(read_records(path))] == [0.9, 0.2, 0.1, 0.5]
    report = tmp_path / "run.json"
    report.write_text(json.dumps({"records": [asdict(r) for r in _records()]}))
    assert len(read_records(report)) == 15
    proc = subprocess.run(
        [sys.executable, "-m", "semblend_sglang.bench", "gate", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.strip() == table(gate_cases(_records()))
    assert "| off | — | 0/4 | 0/2 |" in proc.stdout
    empty = tmp_path / "none.records.jsonl"
    empty.write_text("".join(json.dumps(asdict(r)) + "\n" for r in _records()[:2]))
    failed = subprocess.run(
        [sys.executable, "-m", "semblend_sglang.bench", "gate", str(empty)],
        capture_output=True,
        text=True,
    )
    assert failed.returncode != 0 and "no exact_spans probe" in failed.stderr


def test_accuracy_is_per_dataset_never_pooled() -> None:
    records = [
        *_records(),  # BoolQ: reused 2/4 right, cold 3/4
        *_pair("d0", "Afranji", "The Afranji.", residual=0.05, margin=3.0, gold=NORMAN),  # kept
        *_pair("d1", "Afranji", "the Normans", residual=0.95, margin=0.05, gold=NORMAN),  # lost
        *_pair("r0", "essay", "essay!", residual=0.3, margin=1.0, gold=None),  # no gold answer
    ]
    cases = gate_cases(records)
    assert [c.dataset for c in cases] == ["disflqa"] * 2 + ["boolq"] * 4 + [None]  # by group
    off = evaluate(cases, "residual", None)
    assert off.accuracy == {"boolq": 2 / 4, "disflqa": 1 / 2} and off.lost == 3
    assert evaluate(cases, "residual", 0.92).accuracy == {"boolq": 2 / 4, "disflqa": 1.0}
    rows = table(cases).splitlines()
    assert "accuracy per dataset" in rows[0]
    assert "| boolq 0.500, disflqa 0.500 |" in rows[2]  # the gate off
