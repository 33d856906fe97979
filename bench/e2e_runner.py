"""The e2e job's runner: sends every group to each system's server in the order the
measurements need and keeps one :class:`ProbeRecord` per probe, kind and repeat.

Each group is measured ``repeats`` times; within a repeat, every probe is measured on every
system before the next probe (systems interleaved per probe, so that a burst of load on the
machine hits the systems it compares alike). For each probe, after ``/flush_cache`` on the
server (unless flushing is off):

- exact_spans / substitute / exact_spans_sglang_dispatch: the donors, then the probe
  (``semantic``); in the first repeat, after a flush, the donors again and the probe's
  teacher-forced reference (so that it reuses what the probe reused, never the probe
  itself). The probe's outcome (materialized or not, ``declined:quality_gate`` among the
  reasons), reused and recomputed tokens and the scheduler's time in semblend's hooks come from
  the server's own counters (``GET /semblend/snapshot``) read before and after it. The settings
  each semblend server resolved (the snapshot's ``config``) are read once, before its first
  group.
- vanilla: the donors, then the probe (``prefix``: what SGLang's exact prefix cache gives it);
  after a flush the probe alone (``cold``, the quality baseline); after a flush the first ``c``
  probe tokens then the probe (``exact_same_length``: an exact hit of the length exact_spans did
  not compute in the same repeat).
- reorder (a vanilla server; probes with ``reordered_ids`` only): the donors, then the probe with
  its passages reordered (``reordered``: SGLang's exact prefix cache on the lossless rewrite);
  its answer is compared with vanilla's cold run of the original prompt.
- reorder_spans (a semblend server; probes with ``passage_bounds`` only): the donors, then the
  probe as it is with its passages declared (``semantic``, with the snapshot's counters as for
  exact_spans, and the ``passage_order`` the server chose); its answer is compared with
  vanilla's cold run of the original prompt, its KL replay runs after the prompt the model saw.

With ``answers_only`` (a quality run: one repeat) only the requests whose answers are scored are
sent: the semblend systems' donors and probe, vanilla's cold probe and reorder's; no ``prefix``,
no ``exact_same_length`` and no teacher-forced references (no PPL ratio, no spans/exact).

Quality is deterministic (greedy, float32): the first repeat (``repeat`` 0) decodes
:data:`GREEDY_TOKENS` tokens and reads the reference logprobs (and cold's margins), and every
answer it decodes is replayed cold in a cache namespace of its own (SGLang's KL measure, also
with ``answers_only``); later repeats time the first token only. A probe with a gold answer
(the QA workloads) passes it to its records, and the summary scores the first repeat's output
text against it. Every timed
request also records the foreign load on the machine while it ran (:mod:`.machine_load`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .client import Answer, ServerClient
from .machine_load import LoadMeter, LoadWindow
from .metrics import kl_divergence
from .snapshot_deltas import counter_delta, ms_delta, outcome_delta, residual_delta
from .systems import REORDER, REORDER_SPANS, SEMBLEND_SERVERS, SEMBLEND_SYSTEMS
from .workloads import BenchRequest, GoldAnswer, RequestGroup, Workload, reorder_prompt

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
    copy_ms: float | None = None
    """Semblend servers: the part of ``hook_ms`` spent copying donor K/V into the probe's
    slots (the rotation included)."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    """The logprob the server gave each token of ``output_ids`` as it generated it."""
    replay_logprobs: list[float] = field(default_factory=list)
    """The logprobs of ``output_ids`` teacher-forced through a cold, full prefill of prompt +
    output (:meth:`.client.ServerClient.cold_replay_logprobs`): the other half of SGLang's KL
    measure (:func:`.metrics.kl_divergence`). Repeat 0 of every decoding run (semantic, cold,
    exact_same_length, reordered); empty otherwise."""
    spans: int | None = None
    """Semblend servers: the spans the server materialized for the probe (0 on a miss)."""
    passage_order: list[int] = field(default_factory=list)
    """reorder_spans: the order the server put the probe's declared passages in."""
    text: str = ""
    reference_logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    """The top-1 / top-2 logprob margin of each greedy output position (how close the answer is
    to a different token there), on repeat 0 of vanilla's cold run and of every semblend
    system's probe (the post-hoc guard's signal, :mod:`.gate_eval`); empty on other runs."""
    label: str = ""
    donors: int = field(kw_only=True)
    repeat: int = field(default=0, kw_only=True)
    """Which repeat of the probe (0: the one that also measured quality)."""
    foreign_cores: float | None = field(default=None, kw_only=True)
    """Mean CPU cores used by processes outside the bench while the request ran
    (:mod:`.machine_load`); None when not measured."""
    loadavg: float | None = field(default=None, kw_only=True)
    """The 1-minute load average read around the request; None when not measured."""
    gold: GoldAnswer | None = field(default=None, kw_only=True)
    """The probe's gold answer (the QA workloads; None otherwise): the summary scores ``text``
    against it. Given as a mapping (a record read back from a report's JSON), it is converted
    with :meth:`.workloads.GoldAnswer.from_json`."""

    def __post_init__(self) -> None:
        if isinstance(self.gold, Mapping):
            self.gold = GoldAnswer.from_json(self.gold)

    @property
    def kl(self) -> float | None:
        """SGLang's KL measure of this answer against its cold replay
        (:func:`.metrics.kl_divergence`); None without a replay (a timing repeat, a report
        written before replays were recorded)."""
        out, replay = self.output_logprobs, self.replay_logprobs
        if not out or len(out) != len(replay):
            return None
        return kl_divergence(out, replay)


class Runner:
    """Sends every group of every workload to each system and records the probes
    (``records``) and the settings each semblend server resolved (``configs``: system ->
    the snapshot's ``config``, None from a server that reports none; vanilla is absent).
    ``repeats``: how often each probe is measured (>= 1); ``meter``: reads the foreign load
    around every timed request (None: not recorded); ``sink``: called with every record once it
    is complete, at the end of each group (the incremental records file), never twice;
    ``answers_only``: send only what the answers need (module docstring; ``repeats`` must be
    1)."""

    def __init__(
        self,
        clients: dict[str, ServerClient],
        *,
        greedy_tokens: int = GREEDY_TOKENS,
        flush: bool = True,
        progress: Callable[[int], None] = lambda n: None,
        repeats: int = 1,
        meter: LoadMeter | None = None,
        sink: Callable[[ProbeRecord], None] | None = None,
        answers_only: bool = False,
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, not {repeats}")
        if answers_only and repeats != 1:
            raise ValueError(f"answers_only measures each probe once, not {repeats} times")
        self.clients = clients
        self.greedy_tokens = greedy_tokens
        self.flush = flush
        self.progress = progress
        self.repeats = repeats
        self.meter = meter
        self.sink = sink
        self.answers_only = answers_only
        self.records: list[ProbeRecord] = []
        self.configs: dict[str, dict[str, Any] | None] = {}

    def _flush(self, client: ServerClient) -> None:
        if self.flush:
            client.flush()

    def _generate(
        self,
        client: ServerClient,
        ids: Sequence[int],
        tokens: int,
        margins: bool = False,
        passages: Sequence[tuple[int, int]] = (),
    ) -> tuple[Answer, LoadWindow | None]:
        """One timed request (``passages``: declared), with the foreign load while it ran."""
        before = self.meter.sample() if self.meter is not None else None
        answer = client.generate(ids, tokens, margins=margins, passages=passages)
        if self.meter is None or before is None:
            return answer, None
        return answer, self.meter.window(before, self.meter.sample())

    def _record(
        self,
        workload: Workload,
        group: RequestGroup,
        i: int,
        system: str,
        kind: str,
        timed: tuple[Answer, LoadWindow | None],
        repeat: int,
        **extra: Any,
    ) -> ProbeRecord:
        answer, load = timed
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
            output_logprobs=list(answer.output_logprobs),
            text=answer.text,
            margins=list(answer.margins),
            repeat=repeat,
            foreign_cores=None if load is None else load.foreign_cores,
            loadavg=None if load is None else load.loadavg,
            gold=group.probes[i].gold,
            **extra,
        )
        self.records.append(rec)
        return rec

    def _send_donors(self, client: ServerClient, group: RequestGroup) -> None:
        for donor in group.donors:
            client.generate(donor.prompt_ids, 1)
            self.progress(1)

    def run_group(self, workload: Workload, group: RequestGroup) -> None:
        """Measure one group :attr:`repeats` times; in each repeat, each probe on every system
        (semblend systems first: vanilla's exact_same_length needs the exact_spans reuse
        length of the same repeat)."""
        for system in SEMBLEND_SERVERS:
            client = self.clients.get(system)
            if client is not None and system not in self.configs:
                self.configs[system] = client.config()
        first = len(self.records)
        for repeat in range(self.repeats):
            for i in range(len(group.probes)):
                reused_len = self._semantic(workload, group, i, repeat)
                self._vanilla(workload, group, i, repeat, reused_len)
                self._reordered(workload, group, i, repeat)
                self._reorder_spans(workload, group, i, repeat)
        if self.sink is not None:
            for rec in self.records[first:]:
                self.sink(rec)

    def _semantic(self, workload: Workload, group: RequestGroup, i: int, repeat: int) -> int | None:
        """Probe ``i`` on each semblend system; returns exact_spans' reused length (SGLang's
        exact prefix plus what semblend reused), None when exact_spans did not run."""
        probe = group.probes[i]
        reused_len: int | None = None
        for system in SEMBLEND_SYSTEMS:
            client = self.clients.get(system)
            if client is None:
                continue
            rec = self._semblend_probe(client, workload, group, i, system, repeat)
            if system == "exact_spans":  # SGLang reports its exact prefix only
                reused_len = rec.cached_tokens + (rec.reused_tokens or 0)
            if repeat == 0:
                self._replay(client, rec, probe.prompt_ids)
            if probe.reference_ids and self._reads_reference(repeat):
                # the reference must see the probe's donors, not the probe held as a donor:
                # reusing the probe would repair its state a second time (an optimistic PPL)
                self._flush(client)
                self._send_donors(client, group)
                rec.reference_logprobs = self._reference(client, probe)
        return reused_len

    def _semblend_probe(
        self,
        client: ServerClient,
        workload: Workload,
        group: RequestGroup,
        i: int,
        system: str,
        repeat: int,
        passages: Sequence[tuple[int, int]] = (),
    ) -> ProbeRecord:
        """Probe ``i`` on a semblend server after its donors (``passages``: declared), with the
        server's counters read around it (``semantic``)."""
        probe = group.probes[i]
        tokens = self.greedy_tokens if repeat == 0 else 1
        self._flush(client)
        self._send_donors(client, group)
        before = client.snapshot()
        timed = self._generate(client, probe.prompt_ids, tokens, repeat == 0, passages)
        after = client.snapshot()
        outcome, reused = outcome_delta(before, after)
        rec = self._record(
            workload,
            group,
            i,
            system,
            "semantic",
            timed,
            repeat,
            outcome=outcome,
            reused_tokens=reused,
            recomputed_tokens=counter_delta(before, after, "recomputed_tokens"),
            residual_deviation=residual_delta(before, after),
            hook_ms=ms_delta(before, after, "hook_seconds"),
            copy_ms=ms_delta(before, after, "copy_seconds"),
            spans=counter_delta(before, after, "reused_spans"),
            passage_order=list(timed[0].passage_order),
        )
        self.progress(1)
        return rec

    def _reorder_spans(self, workload: Workload, group: RequestGroup, i: int, repeat: int) -> None:
        """Probe ``i`` with its passages declared, on the reorder_spans server after the group's
        donors; its KL replay after the prompt the server made of it; nothing when the probe
        declares no passages or no reorder_spans server runs."""
        client = self.clients.get(REORDER_SPANS)
        probe = group.probes[i]
        if client is None or not probe.passage_bounds:
            return
        bounds = probe.passage_bounds
        rec = self._semblend_probe(client, workload, group, i, REORDER_SPANS, repeat, bounds)
        if repeat == 0:
            seen = reorder_prompt(probe.prompt_ids, bounds, rec.passage_order)
            self._replay(client, rec, seen)

    def _reads_reference(self, repeat: int) -> bool:
        """Whether repeat ``repeat`` of a probe reads its gold reference's logprobs (the first
        repeat, unless the run sends only what the answers need)."""
        return repeat == 0 and not self.answers_only

    def _vanilla(
        self, workload: Workload, group: RequestGroup, i: int, repeat: int, reused: int | None
    ) -> None:
        """Probe ``i`` on vanilla: after its donors (``prefix``), cold, and the exact hit of
        ``reused`` tokens (``exact_same_length``)."""
        client = self.clients.get("vanilla")
        if client is None:
            return
        probe = group.probes[i]
        full = repeat == 0
        tokens = self.greedy_tokens if full else 1
        if group.donors and not self.answers_only:
            self._flush(client)
            self._send_donors(client, group)
            # TTFT only: its output is not compared with anything
            self._record(
                workload,
                group,
                i,
                "vanilla",
                "prefix",
                self._generate(client, probe.prompt_ids, 1),
                repeat,
            )
            self.progress(1)
        self._flush(client)
        rec = self._record(
            workload,
            group,
            i,
            "vanilla",
            "cold",
            self._generate(client, probe.prompt_ids, tokens, margins=full),
            repeat,
        )
        if self._reads_reference(repeat):
            rec.reference_logprobs = self._reference(client, probe)
        if full:
            self._replay(client, rec, probe.prompt_ids)
        self.progress(1)
        c = reused or 0
        if group.donors and 0 < c < len(probe.prompt_ids) and not self.answers_only:
            self._flush(client)
            client.generate(probe.prompt_ids[:c], 1)
            rec = self._record(
                workload,
                group,
                i,
                "vanilla",
                "exact_same_length",
                self._generate(client, probe.prompt_ids, tokens),
                repeat,
            )
            if full:
                self._replay(client, rec, probe.prompt_ids)
            self.progress(1)

    def _reordered(self, workload: Workload, group: RequestGroup, i: int, repeat: int) -> None:
        """Probe ``i`` with its passages reordered, on the reorder server after the group's
        donors; nothing when the probe has no reordered prompt or no reorder server runs."""
        client = self.clients.get(REORDER)
        probe = group.probes[i]
        if client is None or not probe.reordered_ids:
            return
        full = repeat == 0
        self._flush(client)
        self._send_donors(client, group)
        rec = self._record(
            workload,
            group,
            i,
            REORDER,
            "reordered",
            self._generate(client, probe.reordered_ids, self.greedy_tokens if full else 1),
            repeat,
        )
        if full:
            self._replay(client, rec, probe.reordered_ids)
        self.progress(1)

    @staticmethod
    def _replay(client: ServerClient, rec: ProbeRecord, prompt: Sequence[int]) -> None:
        """``rec``'s answer replayed cold after ``prompt`` (its ``replay_logprobs``)."""
        if rec.output_ids:
            rec.replay_logprobs = client.cold_replay_logprobs(prompt, rec.output_ids)

    def _reference(self, client: ServerClient, probe: BenchRequest) -> list[float]:
        if not probe.reference_ids:
            return []
        return client.reference_logprobs(probe.prompt_ids, probe.reference_ids)


def requests_per_group(
    group: RequestGroup, systems: Sequence[str], repeats: int = 1, answers_only: bool = False
) -> int:
    """How many progress steps :meth:`Runner.run_group` reports for ``group`` measured
    ``repeats`` times (once, sending only what the answers need, with ``answers_only``)."""
    n = 0
    probes = len(group.probes)
    donors = len(group.donors)
    referenced = sum(1 for probe in group.probes if probe.reference_ids)
    resent = 0
    for system in SEMBLEND_SYSTEMS:
        if system in systems:
            n += donors + probes
            if not answers_only:  # the first repeat's reference runs after its donors
                resent += donors * referenced
    if "vanilla" in systems:
        n += probes * (1 + (donors + 2 if donors and not answers_only else 0))
    if REORDER in systems:
        n += sum(donors + 1 for probe in group.probes if probe.reordered_ids)
    if REORDER_SPANS in systems:
        n += sum(donors + 1 for probe in group.probes if probe.passage_bounds)
    return n * repeats + resent
