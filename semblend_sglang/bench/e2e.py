"""The main bench job ``e2e``: every workload against vanilla SGLang and SGLang with semblend.

Systems (one real SGLang server each, started side by side unless ``--url`` names running ones):
``vanilla`` (SEMBLEND_ENABLED=0), ``exact_spans`` and ``substitute`` (semblend in that mode);
chosen with ``--systems`` only, ``exact_spans_sglang_dispatch``: exact_spans with donor-aware
data-parallel dispatch off (SEMBLEND_DISPATCH_ENABLED=0), so that with
``--server-arg=--dp-size --server-arg=N`` SGLang's own ``--load-balance-method`` places every
request; beside ``exact_spans`` it shows what donor-aware dispatch adds. Started servers with
``--dp-size N`` on CPU get ``SGLANG_CPU_OMP_THREADS_BIND`` (one core per rank).
For each workload, context length and group, after ``/flush_cache`` on every server:

- vanilla: the donors, then the probe (``prefix``: what SGLang's exact prefix cache gives it);
  after a flush the probe alone (``cold``: TTFT, 32 greedy tokens, and the reference continuation
  teacher-forced through input logprobs — the quality baseline); after a flush the first ``c``
  probe tokens then the probe (``exact_same_length``: an exact hit of the length exact_spans
  reused, SGLang's own best case);
- exact_spans / substitute: the donors, then the probe (``semantic``) and its reference logprobs.
  Each probe's outcome (materialized or not, reused tokens) is read from the server's own
  counters (``GET /semblend/snapshot``) before and after it: hits are confirmed by the engine.

Control-set probes have no donor; on the semblend servers they measure the miss overhead. TTFT is
streaming and greedy (first chunk carrying a token). Output: console table, JSON (every request
and the environment), PNG plot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from .builtin_workloads import BUILTIN_WORKLOADS
from .client import Answer, ServerClient
from .metrics import (
    greedy_agreement,
    miss_overhead,
    percentile,
    ppl_ratio,
    rouge_l,
)
from .report import environment as report_environment
from .report import write_json
from .workloads import BenchRequest, RequestGroup, Workload

SGLANG_DISPATCH = "exact_spans_sglang_dispatch"
SYSTEMS = ("vanilla", "exact_spans", "substitute", SGLANG_DISPATCH)
DEFAULT_SYSTEMS = ("vanilla", "exact_spans", "substitute")
"""Without ``--systems``: SGLANG_DISPATCH differs from exact_spans only with ``--dp-size``."""
SEMBLEND_SYSTEMS = ("exact_spans", "substitute", SGLANG_DISPATCH)
QUICK_SYSTEMS = ("vanilla", "exact_spans")
"""``--quick`` leaves out the opt-in, output-changing substitute mode (one server fewer)."""
SERVER_ENV: dict[str, dict[str, str]] = {
    "vanilla": {"SEMBLEND_ENABLED": "0"},
    "exact_spans": {"SEMBLEND_ENABLED": "1", "SEMBLEND_MODE": "exact_spans"},
    "substitute": {
        "SEMBLEND_ENABLED": "1",
        "SEMBLEND_MODE": "substitute",
        "SEMBLEND_EXACT_MATERIALIZATION_ONLY": "0",
    },
    SGLANG_DISPATCH: {
        "SEMBLEND_ENABLED": "1",
        "SEMBLEND_MODE": "exact_spans",
        "SEMBLEND_DISPATCH_ENABLED": "0",
    },
}
"""Environment of each system's server (the rest of the SemBlend settings are defaults)."""

GREEDY_TOKENS = 32
FULL_LENGTHS = (512, 1024, 2048)
QUICK_LENGTHS = (512,)
SCHEMA_VERSION = 2


# --------------------------------------------------------------------------- records


@dataclass
class ProbeRecord:
    """Everything measured for one probe of one group on one system."""

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
    hook_ms: float | None = None
    """Semblend servers: the scheduler's time in semblend's hooks during the probe."""
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    reference_logprobs: list[float] = field(default_factory=list)


def _hook_ms_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """Milliseconds the server's schedulers spent in semblend's hooks between two snapshots."""
    if before is None or after is None:
        return None
    return 1000.0 * (float(after.get("hook_seconds", 0.0)) - float(before.get("hook_seconds", 0.0)))


def _outcome_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> tuple[str, int]:
    """The one outcome a request added to the counters, and its reused tokens."""
    if before is None or after is None:
        return "unknown", 0
    changed = [
        name
        for name, count in (after.get("outcomes") or {}).items()
        if count != (before.get("outcomes") or {}).get(name, 0)
    ]
    reused = int(after.get("reused_tokens", 0)) - int(before.get("reused_tokens", 0))
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


# --------------------------------------------------------------------------- runner


class Runner:
    """Sends every group of every workload to each system and records the probes."""

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
            self._flush(client)
            self._send_donors(client, group)
            for i, probe in enumerate(group.probes):
                before = client.snapshot()
                answer = client.generate(probe.prompt_ids, self.greedy_tokens)
                after = client.snapshot()
                outcome, reused = _outcome_delta(before, after)
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
                    hook_ms=_hook_ms_delta(before, after),
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
                client.generate(probe.prompt_ids, self.greedy_tokens),
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


# --------------------------------------------------------------------------- summary


def summarize(records: Sequence[ProbeRecord]) -> list[dict[str, Any]]:
    """One row per (workload, context length): TTFTs, hits and quality (see module doc)."""
    rows: list[dict[str, Any]] = []
    keys = sorted({(r.workload, r.context_tokens) for r in records}, key=lambda k: (k[1], k[0]))
    for workload, ctx in keys:
        mine = [r for r in records if r.workload == workload and r.context_tokens == ctx]
        by = {(r.system, r.kind, r.group_id, r.probe): r for r in mine}
        row: dict[str, Any] = {"workload": workload, "context_tokens": ctx}
        for system, kind in (
            ("vanilla", "cold"),
            ("vanilla", "prefix"),
            ("vanilla", "exact_same_length"),
            ("exact_spans", "semantic"),
            ("substitute", "semantic"),
            (SGLANG_DISPATCH, "semantic"),
        ):
            ttfts = [1000 * r.ttft_s for r in mine if r.system == system and r.kind == kind]
            name = kind if system == "vanilla" else system
            row[f"{name}_ms_p50"] = percentile(ttfts, 50) if ttfts else None
            row[f"{name}_ms_p90"] = percentile(ttfts, 90) if ttfts else None
            row[f"{name}_n"] = len(ttfts)
        for system in SEMBLEND_SYSTEMS:
            probes = [r for r in mine if r.system == system and r.kind == "semantic"]
            if not probes:
                continue
            hits = [r for r in probes if r.outcome == "materialized"]
            row[f"{system}_hit_rate"] = len(hits) / len(probes)
            row[f"{system}_reused_fraction"] = sum(r.reused_tokens or 0 for r in probes) / max(
                1, sum(r.prompt_tokens for r in probes)
            )
            ratios, agreements, rouges = [], [], []
            for r in probes:
                cold = by.get(("vanilla", "cold", r.group_id, r.probe))
                if cold is None:
                    continue
                if r.reference_logprobs and cold.reference_logprobs:
                    ratios.append(ppl_ratio(r.reference_logprobs, cold.reference_logprobs))
                agreements.append(greedy_agreement(r.output_ids, cold.output_ids, GREEDY_TOKENS))
                rouges.append(rouge_l(r.text, cold.text))
            row[f"{system}_ppl_ratio"] = percentile(ratios, 50) if ratios else None
            row[f"{system}_ppl_ratio_max"] = max(ratios) if ratios else None
            row[f"{system}_greedy_agreement"] = (
                sum(agreements) / len(agreements) if agreements else None
            )
            row[f"{system}_rouge_l"] = sum(rouges) / len(rouges) if rouges else None
            if workload == "control":
                cold_ttfts = [
                    1000 * r.ttft_s for r in mine if r.system == "vanilla" and r.kind == "cold"
                ]
                if cold_ttfts:
                    row[f"{system}_miss_overhead"] = miss_overhead(
                        [1000 * r.ttft_s for r in probes], cold_ttfts
                    )
                hook = [r.hook_ms for r in probes if r.hook_ms is not None]
                if hook and cold_ttfts:
                    row[f"{system}_miss_hook_ms"] = percentile(hook, 50)
                    row[f"{system}_miss_overhead_in_scheduler"] = percentile(hook, 50) / percentile(
                        cold_ttfts, 50
                    )
        exact_agree = []
        for r in mine:
            if r.system == "vanilla" and r.kind == "exact_same_length":
                cold = by.get(("vanilla", "cold", r.group_id, r.probe))
                if cold is not None:
                    exact_agree.append(greedy_agreement(r.output_ids, cold.output_ids))
        # The noise floor: the same prompt, cached vs not, on the same server.
        row["exact_greedy_agreement"] = sum(exact_agree) / len(exact_agree) if exact_agree else None
        if row.get("exact_spans_ms_p50") and row.get("exact_same_length_ms_p50"):
            row["exact_spans_over_exact"] = (
                row["exact_spans_ms_p50"] / row["exact_same_length_ms_p50"]
            )
        rows.append(row)
    return rows


def _fmt(value: Any, spec: str = ".0f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def console_table(rows: Sequence[dict[str, Any]]) -> str:
    """The summary as a fixed-width text table."""
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


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """PNG: TTFT p50 by context length per system (workloads with donors); quality per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    lengths = sorted({r["context_tokens"] for r in rows})
    for key, label in (
        ("cold_ms_p50", "cold (vanilla)"),
        ("prefix_ms_p50", "vanilla, donor cached"),
        ("exact_same_length_ms_p50", "exact hit, same length"),
        ("exact_spans_ms_p50", "semblend exact_spans"),
        ("substitute_ms_p50", "semblend substitute"),
        (f"{SGLANG_DISPATCH}_ms_p50", "exact_spans, SGLang's DP dispatch"),
    ):
        ys = []
        for n in lengths:
            vals = [
                r[key]
                for r in rows
                if r["context_tokens"] == n and r["workload"] != "control" and r.get(key)
            ]
            ys.append(sum(vals) / len(vals) if vals else float("nan"))
        ax1.plot(lengths, ys, marker="o", label=label)
    ax1.set_xlabel("context tokens")
    ax1.set_ylabel("TTFT p50 (ms), mean over workloads")
    ax1.set_title("Time to first token")
    ax1.legend(fontsize=8)
    workloads = sorted({r["workload"] for r in rows if r["workload"] != "control"})
    xs = range(len(workloads))
    for offset, (key, label) in enumerate(
        (
            ("exact_spans_greedy_agreement", "exact_spans: greedy agreement"),
            ("exact_spans_rouge_l", "exact_spans: ROUGE-L"),
            ("substitute_greedy_agreement", "substitute: greedy agreement"),
        )
    ):
        vals = []
        for w in workloads:
            got = [r[key] for r in rows if r["workload"] == w and r.get(key) is not None]
            vals.append(sum(got) / len(got) if got else 0.0)
        ax2.bar([x + 0.27 * (offset - 1) for x in xs], vals, width=0.27, label=label)
    ax2.set_xticks(list(xs), workloads, rotation=15)
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Quality vs cold (1.0 = identical)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(model: str, flags: Sequence[str], clients: dict[str, ServerClient]) -> dict:
    """:func:`.report.environment` with the model, server flags and environment, and URLs."""
    from ..server import cpu_dp_environ

    return report_environment(
        model=model,
        server_flags=list(flags),
        server_env={s: SERVER_ENV[s] for s in clients},
        dp_environ=cpu_dp_environ(flags),
        urls={s: c.url for s, c in clients.items()},
    )


# --------------------------------------------------------------------------- command


def _start_servers(
    systems: Sequence[str],
    model: str,
    extra: Sequence[str],
    logs: Path,
    semblend_env: Mapping[str, str] | None = None,
) -> dict:
    from ..server import cpu_dp_environ, free_port, start_server

    servers = {}
    try:
        for system in systems:  # started together: their start-ups overlap
            env = cpu_dp_environ(extra)
            if system in SEMBLEND_SYSTEMS:
                env.update(semblend_env or {})
            env.update(SERVER_ENV[system])  # a system's own settings win
            servers[system] = start_server(
                model,
                port=free_port(),
                extra_args=list(extra),
                env=env,
                log_path=logs / f"e2e-{system}-server.log",
            )
        for server in servers.values():
            server.wait_healthy(timeout=900)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


SYSTEM_OWNED_ENV = ("SEMBLEND_ENABLED", "SEMBLEND_MODE", "SEMBLEND_DISCOVERY_ONLY")
"""Variables each system sets itself (--semblend-env may not override them)."""


def parse_semblend_env(values: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs for the started semblend servers; each KEY must be a SemBlend setting
    (config.FIELDS) other than those in SYSTEM_OWNED_ENV, each VALUE valid for it."""
    from ..config import FIELDS_BY_ENV, ConfigError, parse_value

    out: dict[str, str] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        spec = FIELDS_BY_ENV.get(key)
        if not sep or spec is None or key in SYSTEM_OWNED_ENV:
            raise click.BadParameter(
                f"{value!r}: expected KEY=VALUE with KEY a SEMBLEND_* setting other than "
                f"{', '.join(SYSTEM_OWNED_ENV)}",
                param_hint="'--semblend-env'",
            )
        try:
            parse_value(spec, raw, key)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="'--semblend-env'") from None
        out[key] = raw
    return out


def _parse_urls(values: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        system, sep, url = value.partition("=")
        if not sep or system not in SYSTEMS or not url.startswith("http"):
            raise click.BadParameter(
                f"{value!r}: expected SYSTEM=URL with SYSTEM one of {', '.join(SYSTEMS)}",
                param_hint="'--url'",
            )
        out[system] = url
    return out


@click.command("e2e")
@click.option(
    "--quick",
    is_flag=True,
    help="512 tokens, 1 group per workload, vanilla and exact_spans (< 5 min on 2 cores).",
)
@click.option(
    "--lengths", default=None, help="Context lengths, comma-separated (default 512,1024,2048)."
)
@click.option("--groups", default=None, type=click.IntRange(1, 50), help="Groups per workload.")
@click.option(
    "--workloads",
    "workload_names",
    default=",".join(BUILTIN_WORKLOADS),
    show_default=True,
    help="Built-in workloads to run, comma-separated.",
)
@click.option(
    "--workload",
    "workload_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Your own requests (JSONL, docs/bench-workloads.md) instead of the built-in workloads.",
)
@click.option(
    "--url",
    "urls",
    multiple=True,
    metavar="SYSTEM=URL",
    help="Measure running servers instead of starting them (SYSTEM: "
    f"{', '.join(SYSTEMS)}; repeat for several). They are flushed between groups unless "
    "--no-flush.",
)
@click.option("--flush/--no-flush", default=True, help="Flush server caches between groups.")
@click.option(
    "--systems",
    default=None,
    help=f"Systems, comma-separated, of {','.join(SYSTEMS)} (default "
    f"{','.join(DEFAULT_SYSTEMS)}; with --quick {','.join(QUICK_SYSTEMS)}). "
    f"{SGLANG_DISPATCH}: exact_spans with SGLang's own data-parallel dispatch, to compare with "
    "exact_spans under --server-arg=--dp-size.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--model-path", default=None, help="Model to serve/tokenize (default: SmolLM2).")
@click.option(
    "--server-arg",
    "server_args",
    multiple=True,
    help="Extra sglang flag for started servers (repeat; e.g. --server-arg=--chunked-prefill-size"
    " --server-arg=1024).",
)
@click.option(
    "--semblend-env",
    "semblend_env_values",
    multiple=True,
    metavar="KEY=VALUE",
    help="SemBlend setting for the started semblend servers (repeat; e.g. "
    "--semblend-env SEMBLEND_STRICT_PREFIX_BOUNDARY=0).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def command(
    quick: bool,
    lengths: str | None,
    groups: int | None,
    workload_names: str,
    workload_file: Path | None,
    urls: tuple[str, ...],
    flush: bool,
    systems: str | None,
    seed: int,
    model_path: str | None,
    server_args: tuple[str, ...],
    semblend_env_values: tuple[str, ...],
    out_dir: Path,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """Every workload against vanilla SGLang and semblend (exact_spans, substitute): TTFT,
    server-confirmed hits, quality vs cold, miss overhead. Writes JSON and a PNG plot."""
    from tqdm import tqdm

    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoTokenizer

    from ..data import essay_texts
    from ..model_prep import prepare_model
    from .builtin_workloads import build_workload
    from .workload_file import WorkloadFileError, load_workload_file

    started = time.monotonic()
    if systems is None:
        systems = ",".join(QUICK_SYSTEMS if quick else DEFAULT_SYSTEMS)
    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    bad = [s for s in chosen if s not in SYSTEMS]
    if bad:
        raise click.BadParameter(f"unknown system(s) {bad}", param_hint="'--systems'")
    url_map = _parse_urls(urls)
    semblend_env = parse_semblend_env(semblend_env_values)
    if semblend_env and url_map:
        raise click.BadParameter(
            "applies to started servers only; set it on your servers", param_hint="'--semblend-env'"
        )
    if url_map:
        chosen = [s for s in chosen if s in url_map]
    model = model_path or str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    length_list = (
        [int(x) for x in lengths.split(",")]
        if lengths
        else list(QUICK_LENGTHS if quick else FULL_LENGTHS)
    )
    n_groups = groups or (1 if quick else 2)
    workloads: list[Workload] = []
    if workload_file is not None:
        try:
            workloads.append(load_workload_file(workload_file, tokenizer))
        except WorkloadFileError as exc:
            raise click.ClickException(str(exc)) from exc
    else:
        names = [n.strip() for n in workload_names.split(",") if n.strip()]
        unknown = [n for n in names if n not in BUILTIN_WORKLOADS]
        if unknown:
            raise click.BadParameter(f"unknown workload(s) {unknown}", param_hint="'--workloads'")
        essays = essay_texts()
        for n in length_list:
            for name in names:
                workloads.append(build_workload(name, tokenizer, essays, n, n_groups, seed))

    servers: dict[str, Any] = {}
    if not url_map:
        click.echo(f"starting {len(chosen)} SGLang servers ({', '.join(chosen)}) ...", err=True)
        servers = _start_servers(chosen, model, server_args, out_dir, semblend_env)
        url_map = {s: srv.url for s, srv in servers.items()}
    clients = {s: ServerClient(url_map[s]) for s in chosen}
    total = sum(requests_per_group(g, chosen) for w in workloads for g in w.groups)
    try:
        for client in clients.values():  # first-request costs, not recorded
            client.generate(workloads[0].groups[0].probes[0].prompt_ids[:64], 1)
        with tqdm(total=total, desc="requests", unit="req") as bar:
            runner = Runner(clients, flush=flush, progress=bar.update)
            for workload in workloads:
                for group in workload.groups:
                    bar.set_postfix_str(f"{workload.name} {workload.context_tokens}")
                    runner.run_group(workload, group)
    finally:
        for server in servers.values():
            server.stop()
    rows = summarize(runner.records)
    click.echo(console_table(rows))
    json_path = json_path or out_dir / "e2e.json"
    plot_path = plot_path or out_dir / "e2e.png"
    report = {
        "schema_version": SCHEMA_VERSION,
        "environment": environment(model, server_args, clients),
        "options": {
            "quick": quick,
            "lengths": length_list,
            "groups": n_groups,
            "workloads": sorted({w.name for w in workloads}),
            "systems": chosen,
            "seed": seed,
            "greedy_tokens": GREEDY_TOKENS,
            "flush": flush,
            "semblend_env": semblend_env,
        },
        "wall_s": time.monotonic() - started,
        "summary": rows,
        "records": [asdict(r) for r in runner.records],
    }
    write_json(json_path, report)
    plot(rows, plot_path)
    click.echo(f"wrote {json_path} and {plot_path} ({report['wall_s']:.0f} s)")
