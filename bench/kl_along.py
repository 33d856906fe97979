"""Where along a reused answer SGLang's KL measure rises, judged on e2e records
(``bench kl-along``).

Each *case* is one probe that a semblend system served from reused KV (outcome
``materialized``) on repeat 0, beside vanilla's cold run of the same prompt. Its KL terms are
SGLang's per-token terms (:func:`.metrics.kl_terms`: ``exp(r) - 1 - r``, ``r`` = the cold
replay's logprob of the token the reused run took minus the reused run's own), one per greedy
output position. Read against the first position where the reused answer leaves cold's
(:func:`.metrics.first_divergence`):

- ``before``: the mean term over the positions before it, where both answers took the same
  tokens (how far the reused distribution had drifted while the answers still agreed);
- ``at``: the term at the divergence itself, and cold's top-1 / top-2 margin there (how near
  cold's own answer was to the token the reused run took);
- ``after``: the mean term after it (the reused run decoding its own continuation).

``python -m semblend_sglang.bench kl-along REPORT.records.jsonl`` prints one row per case and
the means over the cases that diverge. Read-only: it never talks to a server.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from .e2e_runner import GREEDY_TOKENS, ProbeRecord
from .gate_eval import no_cases, records_options, runs_beside_cold, wanted_records
from .metrics import first_divergence, kl_terms


@dataclass(frozen=True, slots=True)
class KlAlong:
    """One reused answer's KL terms read against its first divergence from cold.

    ``divergence``: the first differing position within :data:`.e2e_runner.GREEDY_TOKENS`
    (None: the answers agree there); ``before``/``after``: mean terms before/after it (None
    when there are none); ``at``: the term at it; ``cold_margin``: cold's top-1 / top-2
    logprob margin at it (None: not recorded); ``peak``/``peak_at``: the largest term and its
    position; ``kl``: the mean of every term (SGLang's figure for the answer); ``reused`` and
    ``recomputed``: the server's counts of copied and recomputed positions."""

    group_id: str
    kl: float
    divergence: int | None
    before: float | None
    at: float | None
    after: float | None
    cold_margin: float | None
    peak: float
    peak_at: int
    reused: int | None
    recomputed: int | None


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def kl_along(reused: ProbeRecord, cold: ProbeRecord) -> KlAlong | None:
    """``reused``'s KL terms against its divergence from ``cold`` (same probe); None when
    ``reused`` has no replay (a timing repeat)."""
    kl = reused.kl
    if kl is None:
        return None
    terms = kl_terms(reused.output_logprobs, reused.replay_logprobs)
    d = first_divergence(reused.output_ids[:GREEDY_TOKENS], cold.output_ids[:GREEDY_TOKENS])
    at = terms[d] if d is not None and d < len(terms) else None
    margin = cold.margins[d] if d is not None and d < len(cold.margins) else None
    peak_at = max(range(len(terms)), key=terms.__getitem__)
    return KlAlong(
        group_id=reused.group_id,
        kl=kl,
        divergence=d,
        before=_mean(terms[: len(terms) if d is None else d]),
        at=at,
        after=None if d is None else _mean(terms[d + 1 :]),
        cold_margin=margin,
        peak=terms[peak_at],
        peak_at=peak_at,
        reused=reused.reused_tokens,
        recomputed=reused.recomputed_tokens,
    )


def kl_cases(records: Iterable[ProbeRecord], system: str = "exact_spans") -> list[KlAlong]:
    """The cases of ``system``: its repeat-0 probes that reused KV and have a replay, each
    beside vanilla's repeat-0 cold run of the same probe (:func:`.gate_eval.runs_beside_cold`),
    in probe order."""
    pairs = (runs.first_hit() for runs in runs_beside_cold(records, system))
    cases = (kl_along(*pair) for pair in pairs if pair is not None)
    return [case for case in cases if case is not None]


def _fmt(value: float | int | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(cases: Sequence[KlAlong]) -> str:
    """A markdown table, one row per case, then the means over the cases that diverge."""
    lines = [
        "| group | KL | first divergence | KL before | KL at | KL after | cold margin at "
        "| peak (position) | reused | recomputed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(
            f"| {c.group_id} | {c.kl:.1e} | {_fmt(c.divergence, 'd')} | {_fmt(c.before, '.1e')} "
            f"| {_fmt(c.at, '.1e')} | {_fmt(c.after, '.1e')} | {_fmt(c.cold_margin, '.3f')} "
            f"| {c.peak:.1e} ({c.peak_at}) | {_fmt(c.reused, 'd')} | {_fmt(c.recomputed, 'd')} |"
        )
    split = [c for c in cases if c.divergence is not None]
    if split:

        def mean_of(values: Iterable[float | None], spec: str = ".1e") -> str:
            return _fmt(_mean([v for v in values if v is not None]), spec)

        lines.append(
            f"| mean of {len(split)} diverging | {mean_of(c.kl for c in split)} | — "
            f"| {mean_of(c.before for c in split)} | {mean_of(c.at for c in split)} "
            f"| {mean_of(c.after for c in split)} "
            f"| {mean_of((c.cold_margin for c in split), '.3f')} | — | — | — |"
        )
    return "\n".join(lines)


@click.command()
@records_options
def command(records: tuple[Path, ...], system: str, workloads: str) -> None:
    """Per reused answer: SGLang's KL terms before, at and after its first divergence from
    cold, cold's margin there, the largest term and where it is."""
    cases = [c for path in records for c in kl_cases(wanted_records(path, workloads), system)]
    if not cases:
        raise no_cases(system, records)
    click.echo(table(cases))
