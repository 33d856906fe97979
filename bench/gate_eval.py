"""How well a signal picks out the reused answers that differ from cold: the quality gate
(before decoding) and a post-hoc guard (after the first token), judged on e2e records.

Each *case* is one probe that a semblend system served from reused KV (outcome
``materialized``), paired with vanilla's cold run of the same prompt. Two signals:

- ``residual``: the mean relative K/V deviation the recompute budget left at the check layer
  (``residual_deviation``), known before decoding; the quality gate (``quality_gate``)
  recomputes every reused position when it exceeds the threshold. A case is *flagged* when
  the signal is above the threshold.
- ``first_margin``: the top-1 / top-2 logprob margin of the reused run's first output token,
  known after the first forward and before the token is emitted; a guard would recompute the
  request densely. A case is flagged when the margin is below the threshold.

Labels: ``lost`` (cold answered correctly, the reused run did not; QA workloads only) and
``changed`` (the greedy output ids differ from cold). Accuracy is per QA dataset, never pooled
across datasets. The cost is modelled from the records' own TTFTs: a flagged case costs cold's
TTFT under the gate (one dense forward) and the reused TTFT plus cold's under the guard (the
forward ran, then a dense one); an unflagged case costs its reused TTFT. A flagged case answers
as cold does.

``python -m semblend_sglang.bench gate REPORT.records.jsonl`` prints the table. Read-only: it
never talks to a server.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from .e2e_runner import ProbeRecord
from .metrics import score_answer
from .qa_summary import UNNAMED_DATASET, dataset_order

RISK_SIGN = {"residual": 1.0, "first_margin": -1.0}
"""Per signal, +1 when a higher value is riskier (flagged above the threshold), -1 when a lower
one is (flagged below it)."""
SIGNALS = tuple(RISK_SIGN)
FLAGGED_SHARES = (0.1, 0.25, 0.5)
"""The operating points reported per signal: thresholds that flag about these shares."""


@dataclass(frozen=True, slots=True)
class GateCase:
    """One reused probe beside its cold run. ``residual``/``first_margin``: the signals (None:
    not recorded); ``cold_correct``/``reused_correct``: QA scores (None: no gold answer);
    ``changed``: the greedy output differs from cold; TTFTs are medians over repeats;
    ``dataset``: the gold answer's (None: no gold answer)."""

    workload: str
    residual: float | None
    first_margin: float | None
    cold_correct: bool | None
    reused_correct: bool | None
    changed: bool
    cold_ttft_s: float
    reused_ttft_s: float
    dataset: str | None = None

    @property
    def lost(self) -> bool:
        """Cold answered correctly and the reused run did not (False without gold answers)."""
        return bool(self.cold_correct) and self.reused_correct is False

    def signal(self, name: str) -> float | None:
        """The named signal (one of :data:`SIGNALS`)."""
        if name == "residual":
            return self.residual
        if name == "first_margin":
            return self.first_margin
        raise ValueError(f"unknown signal {name!r}; known: {', '.join(SIGNALS)}")


@dataclass(frozen=True, slots=True)
class GatePoint:
    """One threshold of one signal over a set of cases: how many it flags, how many of the
    ``lost``/``changed`` cases it catches, the accuracy once flagged cases answer as cold (per
    dataset: share right, yes/no correct or exact match; empty without gold answers), and the
    modelled speed-up over cold (sum of cold TTFTs over sum of effective TTFTs)."""

    signal: str
    threshold: float | None
    cases: int
    flagged: int
    lost: int
    lost_caught: int
    changed: int
    changed_caught: int
    accuracy: dict[str, float]
    speedup: float

    @property
    def precision(self) -> float | None:
        """Share of flagged cases that were lost (None when none is flagged)."""
        return self.lost_caught / self.flagged if self.flagged else None

    @property
    def recall(self) -> float | None:
        """Share of lost cases flagged (None when none was lost)."""
        return self.lost_caught / self.lost if self.lost else None


def _correct(rec: ProbeRecord) -> bool | None:
    if rec.gold is None:
        return None
    return score_answer(rec.text, rec.gold.kind, rec.gold.answers).correct >= 1.0


@dataclass(frozen=True, slots=True)
class ProbeRuns:
    """Every run of one probe, all repeats in record order: ``reused``, a semblend system's
    semantic runs, and ``cold``, vanilla's cold runs. Built by :func:`runs_beside_cold`."""

    reused: tuple[ProbeRecord, ...]
    cold: tuple[ProbeRecord, ...]

    def first_hit(self) -> tuple[ProbeRecord, ProbeRecord] | None:
        """Repeat 0 of the reused run and of the cold run when the reused one was served from
        reused KV (outcome ``materialized``); None otherwise or when either is missing."""
        reused = next((r for r in self.reused if r.repeat == 0), None)
        cold = next((r for r in self.cold if r.repeat == 0), None)
        if reused is None or cold is None or reused.outcome != "materialized":
            return None
        return reused, cold


def runs_beside_cold(records: Iterable[ProbeRecord], system: str) -> list[ProbeRuns]:
    """Per probe (workload, length, group, probe; in that sorted order) that ``system`` or
    vanilla's cold run measured, its :class:`ProbeRuns`. The judges of reused answers against
    cold (:func:`gate_cases`, :func:`.kl_along.kl_cases`) pair runs here."""
    runs: dict[tuple, dict[str, list[ProbeRecord]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        key = (rec.workload, rec.context_tokens, rec.group_id, rec.probe)
        if rec.system == system and rec.kind == "semantic":
            runs[key]["reused"].append(rec)
        elif rec.system == "vanilla" and rec.kind == "cold":
            runs[key]["cold"].append(rec)
    return [ProbeRuns(tuple(runs[key]["reused"]), tuple(runs[key]["cold"])) for key in sorted(runs)]


def gate_cases(records: Iterable[ProbeRecord], system: str = "exact_spans") -> list[GateCase]:
    """The cases of ``system``: its repeat-0 probes that reused KV, each with vanilla's cold
    run of the same probe; probes without a cold run are left out."""
    cases = []
    for got in runs_beside_cold(records, system):
        pair = got.first_hit()
        if pair is None:
            continue
        first, base = pair
        cases.append(
            GateCase(
                workload=first.workload,
                residual=first.residual_deviation,
                first_margin=first.margins[0] if first.margins else None,
                cold_correct=_correct(base),
                reused_correct=_correct(first),
                changed=list(first.output_ids) != list(base.output_ids),
                cold_ttft_s=statistics.median(r.ttft_s for r in got.cold),
                reused_ttft_s=statistics.median(r.ttft_s for r in got.reused),
                dataset=None if base.gold is None else base.gold.dataset or UNNAMED_DATASET,
            )
        )
    return cases


def flags(case: GateCase, signal: str, threshold: float | None) -> bool:
    """Whether ``threshold`` flags ``case`` (None: the gate is off; a case without the signal
    is never flagged)."""
    value = case.signal(signal)
    if threshold is None or value is None:
        return False
    return RISK_SIGN[signal] * (value - threshold) > 0


def evaluate(cases: Sequence[GateCase], signal: str, threshold: float | None) -> GatePoint:
    """The :class:`GatePoint` of ``signal`` at ``threshold`` over ``cases`` (non-empty)."""
    if not cases:
        raise ValueError("no cases: the records hold no reused probe with a cold run")
    flagged = [flags(c, signal, threshold) for c in cases]
    guard = signal == "first_margin"  # the reused forward ran before the dense one
    cost = sum(
        (c.reused_ttft_s + c.cold_ttft_s if guard else c.cold_ttft_s) if f else c.reused_ttft_s
        for c, f in zip(cases, flagged, strict=True)
    )
    right: dict[str, list[bool]] = defaultdict(list)
    for c, f in zip(cases, flagged, strict=True):
        if c.dataset is not None and c.cold_correct is not None:
            right[c.dataset].append(bool(c.cold_correct if f else c.reused_correct))
    accuracy = {d: sum(right[d]) / len(right[d]) for d in dataset_order(list(right))}
    return GatePoint(
        signal=signal,
        threshold=threshold,
        cases=len(cases),
        flagged=sum(flagged),
        lost=sum(c.lost for c in cases),
        lost_caught=sum(c.lost and f for c, f in zip(cases, flagged, strict=True)),
        changed=sum(c.changed for c in cases),
        changed_caught=sum(c.changed and f for c, f in zip(cases, flagged, strict=True)),
        accuracy=accuracy,
        speedup=sum(c.cold_ttft_s for c in cases) / cost,
    )


def share_thresholds(
    cases: Sequence[GateCase], signal: str, shares: Sequence[float] = FLAGGED_SHARES
) -> list[float]:
    """Thresholds that flag about each share of the cases that carry ``signal`` (riskiest
    first: highest residual, lowest margin), ascending in share, without repeats."""
    values = sorted(
        (v for c in cases if (v := c.signal(signal)) is not None),
        key=lambda v: -RISK_SIGN[signal] * v,
    )
    out: list[float] = []
    for share in shares:
        k = round(share * len(values))
        if k <= 0 or k >= len(values):
            continue
        # halfway between the k-th riskiest value and the next: flags exactly the first k
        cut = (values[k - 1] + values[k]) / 2
        if cut not in out:
            out.append(cut)
    return out


def rank_auc(cases: Sequence[GateCase], signal: str) -> float | None:
    """Probability that a lost case looks riskier on ``signal`` than a case that was not lost
    (ties count half); None without both kinds of case carrying the signal."""
    lost = [v for c in cases if c.lost and (v := c.signal(signal)) is not None]
    kept = [v for c in cases if not c.lost and (v := c.signal(signal)) is not None]
    if not lost or not kept:
        return None
    sign = RISK_SIGN[signal]
    wins = sum(1.0 if sign * (a - b) > 0 else 0.5 if a == b else 0.0 for a in lost for b in kept)
    return wins / (len(lost) * len(kept))


def read_records(path: Path) -> list[ProbeRecord]:
    """The records of an e2e ``.records.jsonl`` file (or a report JSON's ``records``)."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = json.loads(text)["records"]
    return [ProbeRecord(**row) for row in rows]


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _accuracy(point: GatePoint) -> str:
    """``boolq 0.750, disflqa 0.500``; ``—`` without gold answers."""
    return ", ".join(f"{d} {a:.3f}" for d, a in point.accuracy.items()) or "—"


def table(cases: Sequence[GateCase]) -> str:
    """A markdown table: per signal, the gate off, then :func:`share_thresholds`."""
    lines = [
        "| signal | threshold | flagged | lost caught (recall) | precision | changed caught "
        "| accuracy per dataset | modelled speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    off = evaluate(cases, "residual", None)
    lines.append(
        f"| off | — | 0/{off.cases} | 0/{off.lost} | — | 0/{off.changed} "
        f"| {_accuracy(off)} | {off.speedup:.2f}× |"
    )
    for signal in SIGNALS:
        auc = rank_auc(cases, signal)
        for threshold in share_thresholds(cases, signal):
            p = evaluate(cases, signal, threshold)
            lines.append(
                f"| {signal} (AUC {_fmt(auc, '.2f')}) | {threshold:.4g} | {p.flagged}/{p.cases} "
                f"| {p.lost_caught}/{p.lost} ({_fmt(p.recall, '.2f')}) "
                f"| {_fmt(p.precision, '.2f')} | {p.changed_caught}/{p.changed} "
                f"| {_accuracy(p)} | {p.speedup:.2f}× |"
            )
    return "\n".join(lines)


def records_options(command: Callable[..., None]) -> Callable[..., None]:
    """The arguments of a job that judges e2e records (``bench gate``, ``bench kl-along``):
    ``RECORDS...`` (paths), ``--system`` and ``--workloads``; read each path with
    :func:`wanted_records`."""
    for option in (
        click.option("--workloads", default="", help="Only these workloads (comma-separated)."),
        click.option("--system", default="exact_spans", show_default=True, help="Semblend system."),
        click.argument(
            "records", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path)
        ),
    ):
        command = option(command)
    return command


def wanted_records(path: Path, workloads: str) -> list[ProbeRecord]:
    """The records of ``path`` (:func:`read_records`), only those of ``workloads``
    (comma-separated) unless it is empty. A job pairs each file's records on their own (a probe
    of two runs is two cases) and pools the cases."""
    wanted = {w for w in workloads.split(",") if w}
    return [r for r in read_records(path) if not wanted or r.workload in wanted]


def no_cases(system: str, records: Sequence[Path]) -> click.ClickException:
    """The error of a records job that found no case of ``system`` in ``records``."""
    return click.ClickException(f"no {system} probe that reused KV has a cold run in {records}")


@click.command()
@records_options
def command(records: tuple[Path, ...], system: str, workloads: str) -> None:
    """Quality gate and post-hoc guard on e2e records: precision/recall of each signal for
    answers lost against cold, accuracy per dataset once flagged probes answer as cold,
    modelled cost."""
    cases = [c for path in records for c in gate_cases(wanted_records(path, workloads), system)]
    if not cases:
        raise no_cases(system, records)
    click.echo(table(cases))
