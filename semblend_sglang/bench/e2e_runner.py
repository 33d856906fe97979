"""The e2e job's runner: sends every group to each system's server in the order the
measurements need and keeps one :class:`ProbeRecord` per probe and kind.

For each group, after ``/flush_cache`` on every server (unless flushing is off):

- exact_spans / substitute / exact_spans_sglang_dispatch: the donors, then the probe
  (``semantic``: TTFT and :data:`GREEDY_TOKENS` greedy tokens) and its reference logprobs. The
  probe's outcome (materialized or not, ``declined:quality_gate`` among the reasons), reused and
  recomputed tokens and the scheduler's time in semblend's hooks come from the server's own
  counters (``GET /semblend/snapshot``) read before and after it. The settings each semblend
  server resolved (the snapshot's ``config``) are read once, before its first group.
- vanilla: the donors, then the probe (``prefix``: what SGLang's exact prefix cache gives it;
  TTFT only); after a flush the probe alone (``cold``: TTFT, greedy tokens and the reference
  logprobs, the quality baseline); after a flush the first ``c`` probe tokens then the probe
  (``exact_same_length``: an exact hit of the length exact_spans did not compute).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .client import Answer, ServerClient
from .systems import SEMBLEND_SYSTEMS
from .workloads import BenchRequest, RequestGroup, Workload

GREEDY_TOKENS = 32


@dataclass
class ProbeRecord:
    """Everything measured for one probe of one group on one system, with what the summary
    groups it by: the probe's ``label`` (from the workload; a workload file's rows break down by
    it) and ``donors``, the donors of its group (0: a control probe, a miss by design)."""

    workload: str
    context_tokens: int
    group_id: str
    probe: int
    system: str
    kind: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    outcome: str | None = None
    reused_tokens: int | None = None
    recomputed_tokens: int | None = None
    """Semblend servers: reused positions the server recomputed during the probe (the recompute
    budget, or all of them when the quality gate declined); 0 from a server without the
    ``recomputed_tokens`` counter."""
    residual_deviation: float | None = None
    """Semblend servers with a check-layer strategy: the mean relative K/V deviation the
    recompute budget left unrecomputed at the check layer (the quality gate's signal); None
    when the probe reached no check layer."""
    hook_ms: float | None = None
    """Semblend servers: the scheduler's time in semblend's hooks during the probe."""
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    reference_logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    """Vanilla's cold run: the top-1 / top-2 logprob margin of each greedy output position
    (how close the cold answer is to a different token there); empty on other runs."""
    label: str = ""
    donors: int = field(kw_only=True)


def hook_ms_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """Milliseconds the server's schedulers spent in semblend's hooks between two
    ``/semblend/snapshot`` totals; None when either is None (a vanilla server)."""
    if before is None or after is None:
        return None
    return 1000.0 * (float(after.get("hook_seconds", 0.0)) - float(before.get("hook_seconds", 0.0)))


def counter_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, key: str) -> int:
    """How much the numeric counter ``key`` grew between two ``/semblend/snapshot`` totals; 0
    when either is None or lacks the key (an older server without that counter)."""
    if before is None or after is None:
        return 0
    return int(after.get(key, 0)) - int(before.get(key, 0))


def residual_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """The mean residual deviation of the check layers run between two ``/semblend/snapshot``
    totals (``recompute_residual_deviation_sum`` over ``recompute_checks``); None when no
    check ran or a snapshot is None."""
    checks = counter_delta(before, after, "recompute_checks")
    if checks <= 0 or before is None or after is None:
        return None
    key = "recompute_residual_deviation_sum"
    return (float(after.get(key, 0.0)) - float(before.get(key, 0.0))) / checks


def declined_reasons(outcome: str | None) -> frozenset[str]:
    """The decline reasons of an :func:`outcome_delta` outcome (``declined:a,b`` -> {a, b});
    empty for any other outcome or None."""
    if not outcome or not outcome.startswith("declined:"):
        return frozenset()
    return frozenset(r for r in outcome[len("declined:") :].split(",") if r)


def outcome_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> tuple[str, int]:
    """The outcome a request added to the counters between two ``/semblend/snapshot`` totals
    (``materialized``, ``declined:<reasons>``, several joined by commas; ``none`` when no count
    changed, ``unknown`` when either snapshot is None), and the tokens reused meanwhile."""
    if before is None or after is None:
        return "unknown", 0
    changed = [
        name
        for name, count in (after.get("outcomes") or {}).items()
        if count != (before.get("outcomes") or {}).get(name, 0)
    ]
    reused = counter_delta(before, after, "reused_tokens")
    if not changed:
        return "none", reused
    if "declined" in changed:
        reasons = {
            r
            for r, n in (after.get("declined") or {}).items()
            if n != (before.get("declined") or {}).get(r, 0)
        }
        return "declined:" + ",".join(sorted(reasons)), reused
    return ",".join(sorted(changed)), reused


class Runner:
    """Sends every group of every workload to each system and records the probes
    (``records``) and the settings each semblend server resolved (``configs``: system ->
    the snapshot's ``config``, None from a server that reports none; vanilla is absent)."""

    def __init__(
        self,
        clients: dict[str, ServerClient],
        *,
        greedy_tokens: int = GREEDY_TOKENS,
        flush: bool = True,
        progress: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.clients = clients
        self.greedy_tokens = greedy_tokens
        self.flush = flush
        self.progress = progress
        self.records: list[ProbeRecord] = []
        self.configs: dict[str, dict[str, Any] | None] = {}

    def _flush(self, client: ServerClient) -> None:
        if self.flush:
            client.flush()

    def _record(
        self,
        workload: Workload,
        group: RequestGroup,
        i: int,
        system: str,
        kind: str,
        answer: Answer,
        **extra: Any,
    ) -> ProbeRecord:
        rec = ProbeRecord(
            workload=workload.name,
            label=group.probes[i].label,
            donors=len(group.donors),
            context_tokens=workload.context_tokens,
            group_id=group.group_id,
            probe=i,
            system=system,
            kind=kind,
            ttft_s=answer.ttft_s,
            prompt_tokens=answer.prompt_tokens,
            cached_tokens=answer.cached_tokens,
            output_ids=list(answer.output_ids),
            text=answer.text,
            margins=list(answer.margins),
            **extra,
        )
        self.records.append(rec)
        return rec

    def _send_donors(self, client: ServerClient, group: RequestGroup) -> None:
        for donor in group.donors:
            client.generate(donor.prompt_ids, 1)
            self.progress(1)

    def run_group(self, workload: Workload, group: RequestGroup) -> None:
        """Measure one group on every system (semblend systems first: vanilla's
        exact_same_length needs the exact_spans reuse length)."""
        reused_len: dict[int, int] = {}
        for system in SEMBLEND_SYSTEMS:
            client = self.clients.get(system)
            if client is None:
                continue
            if system not in self.configs:
                self.configs[system] = client.config()
            self._flush(client)
            self._send_donors(client, group)
            for i, probe in enumerate(group.probes):
                before = client.snapshot()
                answer = client.generate(probe.prompt_ids, self.greedy_tokens)
                after = client.snapshot()
                outcome, reused = outcome_delta(before, after)
                if system == "exact_spans":  # SGLang reports its exact prefix only
                    reused_len[i] = answer.cached_tokens + reused
                rec = self._record(
                    workload,
                    group,
                    i,
                    system,
                    "semantic",
                    answer,
                    outcome=outcome,
                    reused_tokens=reused,
                    recomputed_tokens=counter_delta(before, after, "recomputed_tokens"),
                    residual_deviation=residual_delta(before, after),
                    hook_ms=hook_ms_delta(before, after),
                )
                rec.reference_logprobs = self._reference(client, probe)
                self.progress(1)
        client = self.clients.get("vanilla")
        if client is None:
            return
        for i, probe in enumerate(group.probes):
            if group.donors:
                self._flush(client)
                self._send_donors(client, group)
                self._record(  # TTFT only: its output is not compared with anything
                    workload,
                    group,
                    i,
                    "vanilla",
                    "prefix",
                    client.generate(probe.prompt_ids, 1),
                )
                self.progress(1)
            self._flush(client)
            rec = self._record(
                workload,
                group,
                i,
                "vanilla",
                "cold",
                client.generate(probe.prompt_ids, self.greedy_tokens, margins=True),
            )
            rec.reference_logprobs = self._reference(client, probe)
            self.progress(1)
            c = reused_len.get(i, 0)
            if group.donors and 0 < c < len(probe.prompt_ids):
                self._flush(client)
                client.generate(probe.prompt_ids[:c], 1)
                self._record(
                    workload,
                    group,
                    i,
                    "vanilla",
                    "exact_same_length",
                    client.generate(probe.prompt_ids, self.greedy_tokens),
                )
                self.progress(1)

    def _reference(self, client: ServerClient, probe: BenchRequest) -> list[float]:
        if not probe.reference_ids:
            return []
        return client.reference_logprobs(probe.prompt_ids, probe.reference_ids)


def requests_per_group(group: RequestGroup, systems: Sequence[str]) -> int:
    """How many progress steps :meth:`Runner.run_group` reports for ``group``."""
    n = 0
    probes = len(group.probes)
    donors = len(group.donors)
    for system in SEMBLEND_SYSTEMS:
        if system in systems:
            n += donors + probes
    if "vanilla" in systems:
        n += probes * (1 + (donors + 2 if donors else 0))
    return n
