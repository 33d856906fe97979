"""The QA part of the e2e summary: a row's first-repeat answers scored against the gold answers
its probes carry (the QA workloads), each dataset on its own, every reuse source paired with
vanilla's cold run of the same probe (agreement, McNemar). :func:`.e2e_summary.summarize` calls
:func:`qa_columns` per row; the report and ``bench table`` print :func:`qa_lines`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .e2e_runner import GREEDY_TOKENS, ProbeRecord
from .metrics import (
    QAScore,
    greedy_agreement,
    mcnemar_exact,
    mean_or_none,
    read_answer,
    score_answer,
)
from .qa_data import QA_DATASETS
from .systems import REORDER, REORDER_SPANS, SGLANG_DISPATCH
from .workloads import GoldAnswer

QA_SOURCES: tuple[tuple[str, str, str], ...] = (
    ("cold", "vanilla", "cold"),
    ("exact_same_length", "vanilla", "exact_same_length"),
    ("exact_spans", "exact_spans", "semantic"),
    ("substitute", "substitute", "semantic"),
    (SGLANG_DISPATCH, SGLANG_DISPATCH, "semantic"),
    (REORDER, REORDER, "reordered"),
    (REORDER_SPANS, REORDER_SPANS, "semantic"),
)
"""(source, system, kind) of the outputs scored against gold answers, per dataset
(:func:`qa_columns`); ``cold`` is the baseline the others are paired with."""
UNNAMED_DATASET = "unnamed"
"""The dataset name of a gold answer that names none."""


def _gold(rec: ProbeRecord) -> GoldAnswer:
    if rec.gold is None:
        raise ValueError(f"{rec.group_id} probe {rec.probe} on {rec.system} has no gold answer")
    return rec.gold


def _qa_score(rec: ProbeRecord) -> QAScore:
    gold = _gold(rec)
    return score_answer(rec.text, gold.kind, gold.answers)


def _qa_means(scored: Sequence[tuple[ProbeRecord, QAScore]], prefix: str = "") -> dict[str, Any]:
    """``{prefix}accuracy`` (mean correct over the ``yes_no`` and ``number`` probes: answers right
    or wrong as a whole), ``{prefix}em`` and ``{prefix}f1`` (mean exact match and token F1 over
    the ``span`` probes), ``{prefix}rouge_l`` (mean ROUGE-L against the reference over the
    ``summary`` probes); None where the probes have no answer of that kind."""
    whole = [s.correct for r, s in scored if _gold(r).kind in ("yes_no", "number")]
    spans = [s for r, s in scored if _gold(r).kind == "span"]
    return {
        f"{prefix}accuracy": mean_or_none(whole),
        f"{prefix}em": mean_or_none([s.correct for s in spans]),
        f"{prefix}f1": mean_or_none([s.f1 for s in spans if s.f1 is not None]),
        f"{prefix}rouge_l": mean_or_none([s.rouge_l for _, s in scored if s.rouge_l is not None]),
    }


def _qa_paired(pairs: Sequence[tuple[ProbeRecord, ProbeRecord]]) -> dict[str, Any]:
    """A reuse source's probes (first of each pair) against cold's run of the same probe."""
    reused = [(r, _qa_score(r)) for r, _ in pairs]
    cold = [(c, _qa_score(c)) for _, c in pairs]
    right = [  # a summary is neither right nor wrong: not in b and c
        (cold_score.correct >= 1.0, score.correct >= 1.0)
        for (r, score), (_, cold_score) in zip(reused, cold, strict=True)
        if _gold(r).kind != "summary"
    ]
    b = sum(was and not now for was, now in right)
    c = sum(now and not was for was, now in right)
    agree = [
        read_answer(r.text, _gold(r).kind) == read_answer(k.text, _gold(r).kind) for r, k in pairs
    ]
    greedy = [greedy_agreement(r.output_ids, k.output_ids, GREEDY_TOKENS) for r, k in pairs]
    return {
        "paired": len(pairs),
        **_qa_means(cold, "cold_"),
        "agreement": mean_or_none([float(a) for a in agree]),
        "greedy_agreement": mean_or_none(greedy),
        "b": b,
        "c": c,
        "mcnemar_p": mcnemar_exact(b, c),
    }


def dataset_order(names: Sequence[str]) -> list[str]:
    """``names`` without repeats: :data:`.qa_data.QA_DATASETS` first, in their order, then
    the others sorted."""
    known = [d for d in QA_DATASETS if d in names]
    return known + sorted(set(names) - set(known))


def qa_columns(mine: Sequence[ProbeRecord]) -> dict[str, Any]:
    """A row's first-repeat answers (``text``) scored against the gold answers its probes carry (the
    QA workloads; :func:`.metrics.score_answer`), each dataset on its own.

    ``qa_probes``: probes with a gold answer; ``qa_span_probes``: of them, those with span
    answers. ``qa_by_dataset``: dataset (the gold answer's; :data:`UNNAMED_DATASET` when it names
    none) -> source (:data:`QA_SOURCES`, those with a scored probe) -> cell. Every cell: ``n``
    (probes scored), ``accuracy`` (share of yes/no and number answers right), ``em`` and ``f1``
    (mean SQuAD exact match and token F1 of span answers), ``rouge_l`` (mean ROUGE-L of summaries
    against their reference), ``kl`` (mean of SGLang's KL measure of the answers against their
    cold replays, :attr:`.ProbeRecord.kl`); a mean is None where the dataset has no answer of its
    kind (no replay: ``kl``). A source other than ``cold`` adds, over its ``paired`` probes
    (those with vanilla's cold run of the same probe): ``cold_accuracy``, ``cold_em``,
    ``cold_f1``, ``cold_rouge_l`` (cold's scores on them), ``agreement`` (share whose
    :func:`.metrics.read_answer` equals cold's), ``greedy_agreement`` (mean agreement of the
    first 32 greedy tokens with cold's), ``b`` (right cold, wrong here; right: a yes/no or number
    answer correct or a span's exact match; summaries are not counted), ``c`` (the reverse) and
    ``mcnemar_p`` (:func:`.metrics.mcnemar_exact`); the means are None and the counts 0 when none
    is paired. Empty ``qa_by_dataset`` in rows without gold answers. :func:`summarize` calls it
    per row.
    """
    asked = {(r.group_id, r.probe): r.gold for r in mine if r.gold is not None}
    scored = [r for r in mine if r.gold is not None and r.repeat == 0]
    cold_of = {
        (r.group_id, r.probe): r for r in scored if r.system == "vanilla" and r.kind == "cold"
    }
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    for source, system, kind in QA_SOURCES:
        by_dataset: dict[str, list[ProbeRecord]] = {}
        for r in scored:
            if r.system == system and r.kind == kind:
                by_dataset.setdefault(_gold(r).dataset or UNNAMED_DATASET, []).append(r)
        for dataset, runs in by_dataset.items():
            cell: dict[str, Any] = {"n": len(runs), **_qa_means([(r, _qa_score(r)) for r in runs])}
            cell["kl"] = mean_or_none([v for r in runs if (v := r.kl) is not None])
            if source != "cold":
                pairs = [
                    (r, cold_of[(r.group_id, r.probe)])
                    for r in runs
                    if (r.group_id, r.probe) in cold_of
                ]
                cell.update(_qa_paired(pairs))
            cells.setdefault(dataset, {})[source] = cell
    return {
        "qa_probes": len(asked),
        "qa_span_probes": sum(g.kind == "span" for g in asked.values()),
        "qa_by_dataset": {d: cells[d] for d in dataset_order(list(cells))},
    }


def qa_lines(row: Mapping[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(dataset, source, cell) of a summary row's :func:`qa_columns` cells as a table shows
    them: per dataset, each source other than ``cold`` in :data:`QA_SOURCES` order, or the
    ``cold`` cell alone when no other source ran."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for dataset, sources in (row.get("qa_by_dataset") or {}).items():
        reuse = [(s, sources[s]) for s, _, _ in QA_SOURCES if s != "cold" and s in sources]
        if not reuse and "cold" in sources:
            reuse = [("cold", sources["cold"])]
        out += [(dataset, source, cell) for source, cell in reuse]
    return out
