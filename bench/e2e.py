"""The main bench job ``e2e``: every workload against vanilla SGLang and SGLang with semblend.

The systems (one real SGLang server each, started side by side, but those ``--url`` names
running) are :mod:`.systems`; what is sent to them, in which order, is :mod:`.e2e_runner`; the
summary rows :mod:`.e2e_summary`; the console table and JSON :mod:`.report`; the PNG
:mod:`.plot`. This module is the command: options, workloads, servers, and the report file.

Control-set probes have no donor; on the semblend servers they measure the miss overhead. TTFT is
streaming and greedy (first chunk carrying a token). Output: console table headed by the
recompute settings each semblend server resolved, JSON (every request, the environment and each
semblend server's resolved settings), PNG plot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import click

from .builtin_workloads import BUILTIN_WORKLOADS, QUICK_WORKLOADS
from .client import ServerClient
from .e2e_runner import GREEDY_TOKENS, ProbeRecord, Runner, requests_per_group
from .e2e_summary import summarize
from .machine_load import FOREIGN_LOAD_LIMIT, LoadMeter, listening_pid, tree_peak_rss_bytes
from .metrics import mean_or_none
from .plot import plot
from .report import console_table, settings_lines, write_json
from .report import environment as report_environment
from .systems import (
    DEFAULT_SYSTEMS,
    QUICK_SYSTEMS,
    REORDER,
    REORDER_SPANS,
    SERVER_ENV,
    SGLANG_DISPATCH,
    SYSTEMS,
    parse_semblend_env,
    parse_urls,
    plan_servers,
    start_servers,
)
from .workloads import Workload

_T = TypeVar("_T")

FULL_LENGTHS = (512, 1024, 2048)
QUICK_LENGTHS = (512,)
DEFAULT_REPEATS = 3
SCHEMA_VERSION = 16
"""3: summary rows carry ``label`` and ``control``, records ``label`` and ``donors``; a
``--workload`` file gives one row per probe label. 4: ``semblend_config`` (system -> the
settings its server resolved, None when it reported none; semblend systems only); summary rows
carry per semblend system ``_recompute_strategy``, ``_recompute_ratio``,
``_recompute_check_layer``, ``_quality_gate`` (resolved; None: not reported),
``_gate_declines``, ``_recomputed_tokens`` and ``_recompute_share``; records
``recomputed_tokens``. 5: vanilla's cold records carry ``margins`` (top-1 / top-2 logprob per
output position); summary rows per semblend system ``_divergent_hits``,
``_divergence_margin`` and ``_divergence_margin_max``. 6: ``--repeats``: records carry
``repeat``, ``foreign_cores`` and ``loadavg``; summary rows carry TTFT ``_ms_min``/``_ms_max``,
paired ratios ``exact_spans_over_exact`` and ``exact_spans_speedup`` (medians, with ``_min``,
``_max``, ``_n``), ``_miss_overhead`` as a median of paired ratios (``_min``, ``_max``),
``noisy``, ``noisy_why`` and ``foreign_cores_max``; the report has ``noise`` (run level). 7: the
report has ``server_peak_rss_bytes`` (system -> the started server tree's summed ``VmHWM``; none
for a ``--url``); every record is also appended to ``<json stem>.records.jsonl`` as it is made.
8: the QA workloads (``qa_rag``, ``qa_rag_corpus``): records carry ``gold`` (the probe's gold
answer: ``kind``, ``answers``, ``dataset``; null for other workloads); summary rows carry
``qa_probes``, ``qa_span_probes`` and per scored source (cold, exact_same_length, exact_spans,
substitute, exact_spans_sglang_dispatch) ``_accuracy``, ``_f1`` and ``_qa_n``; and per semblend
system ``_recompute_min_deviation`` (resolved; None: not reported). 9: semblend systems'
probe records of repeat 0 carry ``margins`` too (:mod:`.gate_eval` reads them). 10: summary
rows carry per semblend system ``_recompute_check_share`` and ``_recompute_check_max_spans``
(resolved; None: not reported);
semblend systems' ``reference_logprobs`` come from a request sent after a flush and the group's
donors again (before, it could reuse the probe itself and be repaired twice). 11: summary rows
carry ``qa_by_dataset`` (dataset -> source -> scores, agreement with cold, McNemar's paired
test; :func:`.qa_summary.qa_columns`) instead of the cross-dataset ``_accuracy``, ``_f1`` and
``_qa_n``. 12: the ``reorder`` system (records: system ``reorder``, kind ``reordered``); summary
rows carry ``reorder_ms_*``, ``exact_spans_over_reorder`` (paired, with ``_min``, ``_max``,
``_n``), ``reorder_cached_fraction``, ``reorder_greedy_agreement`` and a ``reorder`` source in
``qa_by_dataset``; per semblend system ``_recompute_check_span_limit`` (resolved). 13: options
carry ``answers_only`` (``--answers-only``: no ``prefix`` or ``exact_same_length`` records, no
``reference_logprobs``). 14: semblend systems' records carry ``copy_ms`` (the donor K/V copy's
part of ``hook_ms``); summary rows ``_hit_hook_ms`` and ``_hit_copy_ms`` (medians over the
materialized probes). 15: records carry ``output_logprobs``, ``replay_logprobs`` (repeat 0:
the answer replayed cold) and, on semblend systems, ``spans``; summary rows carry SGLang's KL
measure: per semblend system ``_kl``, ``_kl_max``, ``_kl_one_span``, ``_kl_multi_span``, and
``exact_kl``, ``cold_kl``, ``reorder_kl`` (each with ``_max``). 16: the ``reorder_spans``
system (records carry ``passage_order``); summary rows its semblend columns (``reorder_spans_*``),
``reorder_spans_speedup``, ``reorder_spans_over_reorder``, ``reorder_spans_cached_fraction``,
``reorder_spans_held_fraction``, ``reorder_spans_reordered``; passage labels name no place."""


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


def run_noise(records: Sequence[ProbeRecord], rows: Sequence[dict]) -> dict[str, Any]:
    """The report's run-level ``noise``: the foreign load (cores used by other processes while
    requests ran: mean and max over the timed requests), the largest 1-minute load average
    read, the limit that flags a row, and how many rows are noisy."""
    loads = [r.foreign_cores for r in records if r.foreign_cores is not None]
    avgs = [r.loadavg for r in records if r.loadavg is not None]
    return {
        "foreign_cores_mean": mean_or_none(loads),
        "foreign_cores_max": max(loads) if loads else None,
        "loadavg_max": max(avgs) if avgs else None,
        "foreign_load_limit": FOREIGN_LOAD_LIMIT,
        "noisy_rows": sum(bool(row.get("noisy")) for row in rows),
        "rows": len(rows),
    }


def parse_comma_list(text: str, option: str, convert: Callable[[str], _T], what: str) -> list[_T]:
    """A bench flag's comma-separated values, each through ``convert`` (which raises
    ValueError for a part that is not one). Raises :class:`click.BadParameter` naming
    ``option``: ``'<part>' is not <what>``. The bench commands' flag parsers call it."""
    out: list[_T] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            out.append(convert(part))
        except ValueError:
            raise click.BadParameter(f"{part!r} is not {what}", param_hint=f"'{option}'") from None
    return out


def _context_length(part: str) -> int:
    value = int(part)
    if value < 64:
        raise ValueError(part)
    return value


def model_context_length(model: str) -> int | None:
    """The served model's context window (``max_position_embeddings`` of its config.json), or
    None when the folder has no such config."""
    import json

    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    window = json.loads(config.read_text()).get("max_position_embeddings")
    return int(window) if window else None


def parse_lengths(text: str) -> list[int]:
    """``--lengths``: comma-separated context lengths in tokens, each at least 64. Raises
    :class:`click.BadParameter` naming the option for anything else."""
    return parse_comma_list(
        text, "--lengths", _context_length, "a context length (an integer >= 64)"
    )


def _workload_over_essays(
    name: str, tokenizer: Any, essays: list[str], fit: int, n_groups: int, seed: int
) -> Workload:
    """``build_workload`` over the essays; when a slice fits no single essay (a long context),
    over the essays joined into texts long enough (:func:`.essay_pool.joined_essays`), said on
    stderr."""
    from .builtin_workloads import build_workload
    from .essay_pool import REFERENCE_TOKENS, EssaysTooShort, joined_essays

    try:
        return build_workload(name, tokenizer, essays, fit, n_groups, seed)
    except EssaysTooShort:
        click.echo(
            f"{name} at {fit} tokens: essays joined (no single essay is long enough)", err=True
        )
        joined = joined_essays(tokenizer, essays, fit + REFERENCE_TOKENS + 64)
        return build_workload(name, tokenizer, joined, fit, n_groups, seed)


@click.command("e2e")
@click.option(
    "--quick",
    is_flag=True,
    help="512 tokens, 1 group per workload, vanilla and exact_spans, every workload but "
    "qa_rag_corpus (< 5 min on 2 cores).",
)
@click.option(
    "--repeats",
    default=None,
    type=click.IntRange(1, 20),
    help=f"Measurements of each probe on each system (systems interleaved per probe); the "
    f"first also measures quality (default {DEFAULT_REPEATS}; 1 with --answers-only).",
)
@click.option(
    "--answers-only",
    is_flag=True,
    help="A quality run: each probe once, only the requests whose answers are scored (no "
    "vanilla prefix or exact-hit TTFT, no PPL references), so that a run of many probes "
    "takes about half the time. TTFT columns are then cold and reuse only.",
)
@click.option(
    "--lengths", default=None, help="Context lengths, comma-separated (default 512,1024,2048)."
)
@click.option("--groups", default=None, type=click.IntRange(1, 200), help="Groups per workload.")
@click.option(
    "--workloads",
    "workload_names",
    default=None,
    help=f"Built-in workloads to run, comma-separated, of {','.join(BUILTIN_WORKLOADS)} "
    f"(default: all; with --quick {','.join(QUICK_WORKLOADS)}).",
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
    help="Measure a running server for SYSTEM (one of "
    f"{', '.join(SYSTEMS)}; repeat for several) instead of starting one; the --systems not "
    "named are started. Flushed between groups unless --no-flush.",
)
@click.option("--flush/--no-flush", default=True, help="Flush server caches between groups.")
@click.option(
    "--wide",
    is_flag=True,
    help="Print every column of the console table (default: the ones a user reads first; the "
    "JSON and the plot always hold everything).",
)
@click.option(
    "--systems",
    default=None,
    help=f"Systems, comma-separated, of {','.join(SYSTEMS)} (default "
    f"{','.join(DEFAULT_SYSTEMS)}; with --quick {','.join(QUICK_SYSTEMS)}). "
    f"{SGLANG_DISPATCH}: exact_spans with SGLang's own data-parallel dispatch, to compare with "
    f"exact_spans under --server-arg=--dp-size. {REORDER}: vanilla SGLang sent each probe of "
    "passages (rag, rag_corpus, the QA workloads) with its passages in a donor's order; "
    f"{REORDER_SPANS}: semblend sent it as it is with its passages declared.",
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
    "--semblend-env SEMBLEND_RECOMPUTE_STRATEGY=heads --semblend-env "
    "SEMBLEND_RECOMPUTE_RATIO=0.05). The report names the settings the servers resolved.",
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
    repeats: int | None,
    answers_only: bool,
    lengths: str | None,
    groups: int | None,
    workload_names: str | None,
    workload_file: Path | None,
    urls: tuple[str, ...],
    flush: bool,
    wide: bool,
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
    from .builtin_workloads import fitting_length
    from .essay_pool import REFERENCE_TOKENS
    from .workload_file import WorkloadFileError, load_workload_file

    started = time.monotonic()
    if answers_only and repeats not in (None, 1):
        raise click.BadParameter(
            "measures each probe once: leave --repeats out or give 1",
            param_hint="'--answers-only'",
        )
    repeats = repeats or (1 if answers_only else DEFAULT_REPEATS)
    semblend_env = parse_semblend_env(semblend_env_values)
    default = QUICK_SYSTEMS if quick else DEFAULT_SYSTEMS
    plan = plan_servers(systems, default, parse_urls(urls), semblend_env)
    chosen = plan.systems
    length_list = (
        parse_lengths(lengths) if lengths else list(QUICK_LENGTHS if quick else FULL_LENGTHS)
    )
    if workload_names is None:
        workload_names = ",".join(QUICK_WORKLOADS if quick else BUILTIN_WORKLOADS)
    names = [n.strip() for n in workload_names.split(",") if n.strip()]
    unknown = [n for n in names if n not in BUILTIN_WORKLOADS]
    if unknown and workload_file is None:
        raise click.BadParameter(f"unknown workload(s) {unknown}", param_hint="'--workloads'")
    model = model_path or str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    n_groups = groups or (1 if quick else 2)
    workloads: list[Workload] = []
    if workload_file is not None:
        try:
            workloads.append(load_workload_file(workload_file, tokenizer))
        except WorkloadFileError as exc:
            raise click.ClickException(str(exc)) from exc
    else:
        essays = essay_texts()
        window = model_context_length(model)
        for n in length_list:
            fit = n if window is None else fitting_length(n, window, GREEDY_TOKENS)
            if fit != n:
                click.echo(
                    f"--lengths {n}: prompts of {fit} tokens, so that donors, the "
                    f"{GREEDY_TOKENS}-token answers and the {REFERENCE_TOKENS}-token references "
                    f"stay inside the model's {window}-token context",
                    err=True,
                )
            for name in names:
                workloads.append(
                    _workload_over_essays(name, tokenizer, essays, fit, n_groups, seed)
                )

    servers: dict[str, Any] = {}
    if plan.to_start:
        click.echo(
            f"starting {len(plan.to_start)} SGLang servers ({', '.join(plan.to_start)}) ...",
            err=True,
        )
        servers = start_servers(plan.to_start, model, server_args, out_dir, semblend_env)
    url_map = {**plan.urls, **{s: srv.url for s, srv in servers.items()}}
    clients = {s: ServerClient(url_map[s]) for s in chosen}
    total = sum(
        requests_per_group(g, chosen, repeats, answers_only) for w in workloads for g in w.groups
    )
    # A server --url names counts as the bench's own when it listens on this machine; one
    # elsewhere would read as foreign load (or none), so then the load is not measured.
    named = [listening_pid(url) for url in plan.urls.values()]
    pids = [srv.process.pid for srv in servers.values()] + [p for p in named if p is not None]
    meter = LoadMeter(pids) if None not in named else None
    json_path = json_path or out_dir / "e2e.json"
    records_path = json_path.with_suffix(".records.jsonl")
    records_path.parent.mkdir(parents=True, exist_ok=True)
    peak_rss: dict[str, int] = {}
    with records_path.open("w") as records_file:

        def keep(record: ProbeRecord) -> None:
            records_file.write(json.dumps(asdict(record)) + "\n")
            records_file.flush()

        try:
            for client in clients.values():  # first-request costs, not recorded
                client.generate(workloads[0].groups[0].probes[0].prompt_ids[:64], 1)
            with tqdm(total=total, desc="requests", unit="req") as bar:
                runner = Runner(
                    clients,
                    flush=flush,
                    progress=bar.update,
                    repeats=repeats,
                    meter=meter,
                    sink=keep,
                    answers_only=answers_only,
                )
                for workload in workloads:
                    for group in workload.groups:
                        bar.set_postfix_str(f"{workload.name} {workload.context_tokens}")
                        runner.run_group(workload, group)
        finally:
            for system, server in servers.items():
                peak_rss[system] = tree_peak_rss_bytes([server.process.pid])
                server.stop()
    rows = summarize(runner.records, by_label=workload_file is not None, configs=runner.configs)
    for line in settings_lines(runner.configs):
        click.echo(line)
    click.echo(console_table(rows, wide=wide))
    noise = run_noise(runner.records, rows)
    if noise["foreign_cores_max"] is not None:
        click.echo(
            f"foreign load while measuring: mean {noise['foreign_cores_mean']:.2f}, max "
            f"{noise['foreign_cores_max']:.2f} cores (flag above {FOREIGN_LOAD_LIMIT}); "
            f"{noise['noisy_rows']} of {noise['rows']} rows noisy"
        )
    for system, peak in peak_rss.items():
        click.echo(f"{system} server peak memory (summed VmHWM): {peak / 2**30:.2f} GiB")
    plot_path = plot_path or out_dir / "e2e.png"
    report = {
        "schema_version": SCHEMA_VERSION,
        "environment": environment(model, server_args, clients),
        "options": {
            "quick": quick,
            "lengths": length_list,
            "groups": n_groups,
            "repeats": repeats,
            "answers_only": answers_only,
            "workloads": sorted({w.name for w in workloads}),
            "workload_file": None if workload_file is None else str(workload_file),
            "systems": chosen,
            "seed": seed,
            "greedy_tokens": GREEDY_TOKENS,
            "flush": flush,
            "semblend_env": semblend_env,
        },
        "semblend_config": runner.configs,
        "wall_s": time.monotonic() - started,
        "noise": noise,
        "server_peak_rss_bytes": peak_rss,
        "summary": rows,
        "records": [asdict(r) for r in runner.records],
    }
    write_json(json_path, report)
    plot(rows, plot_path)
    click.echo(f"wrote {json_path} and {plot_path} ({report['wall_s']:.0f} s)")
