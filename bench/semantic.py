"""The ``semantic`` bench job: semantic-hit TTFT beside cold and an exact hit of the same length.

One SGLang server with semblend enabled. Per sample (a different real essay each, cut to
``--doc-tokens`` SmolLM2 tokens), after ``/flush_cache``:

- cold: instruction A + document (this request becomes the donor);
- semantic: instruction B + document (the server reuses the donor's KV for the document);
- exact: the cache is flushed, the first ``c`` tokens of the semantic prompt are sent on their own,
  then the semantic prompt again, where ``c`` is what the semantic request did not compute (its
  ``cached_tokens``, the exact prefix, plus the tokens semblend reused) — an exact prefix hit of
  the same reused length, SGLang's own best case;
- miss: a prompt of the same length from an essay no request has used (no donor).

With ``--vanilla`` (default) a vanilla server (``SEMBLEND_ENABLED=0``, same flags) runs beside it
and gets the identical sequence, sample by sample, alternating which server goes first.

The miss overhead is reported two ways: the miss TTFT against the vanilla server's (an A/B, as
noisy as the machine: p50 ratio and the median of per-sample ratios), and the time the
scheduler spent in semblend's hooks while the miss request ran (``hook_seconds`` of
``GET /semblend/snapshot``, read before and after it: lookup, donor registration and every other
hook), divided by the cold TTFT.

All TTFTs are streaming, greedy; semantic reuse is read from the server's own counters
(``GET /semblend/snapshot``: SGLang's ``cached_tokens`` reports the exact prefix only).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from .client import flush_cache, semblend_snapshot, stream_generate
from .metrics import percentile
from .ttft import write_report

INSTRUCTION_A = "Summarize the following essay in three sentences.\n\n"
INSTRUCTION_B = "Read the essay below carefully and list the author's main arguments.\n\n"
ANSWER_TOKENS = 2
"""Tokens generated per request (TTFT needs one; two as the ``ttft`` job)."""


@dataclass(frozen=True)
class SemanticSample:
    """TTFTs (seconds) and server-reported cached tokens of one sample."""

    essay: str
    prompt_tokens: int
    cold_s: float
    semantic_s: float
    semantic_cached: int
    exact_s: float
    exact_cached: int
    miss_s: float
    semantic_hook_ms: float
    """Time the scheduler spent in semblend's hooks during the semantic request."""
    miss_hook_ms: float
    """Time the scheduler spent in semblend's hooks during the miss request."""


def _prompts(doc_tokens: int, samples: int) -> list[tuple[str, list[int], list[int], list[int]]]:
    """(essay, prompt A, prompt B, miss prompt) per sample; deterministic."""
    from transformers import AutoTokenizer

    from ..data import essay_files
    from ..model_prep import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model())
    a = tok.encode(INSTRUCTION_A, add_special_tokens=False)
    b = tok.encode(INSTRUCTION_B, add_special_tokens=False)
    docs = []
    for path in essay_files():
        ids = tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) >= doc_tokens + len(b):
            docs.append((path.stem, ids))
    if len(docs) < 2 * samples:
        raise click.ClickException(f"only {len(docs)} essays have {doc_tokens} tokens")
    out = []
    for i in range(samples):
        name, ids = docs[i]
        _, other = docs[samples + i]
        doc = ids[:doc_tokens]
        out.append((name, a + doc, b + doc, other[: len(b) + doc_tokens]))
    return out


def _hook_ms(url: str, run: Any) -> tuple[Any, float, int]:
    """``run()``'s result, the hook time (ms) the server's schedulers spent while it ran, and
    the tokens semblend reused meanwhile."""
    before = semblend_snapshot(url) or {}
    out = run()
    after = semblend_snapshot(url) or {}
    spent = float(after.get("hook_seconds", 0.0)) - float(before.get("hook_seconds", 0.0))
    reused = int(after.get("reused_tokens", 0)) - int(before.get("reused_tokens", 0))
    return out, 1000.0 * spent, reused


Prompt = tuple[str, list[int], list[int], list[int]]
"""(essay, prompt A, prompt B, miss prompt) of one sample."""


def run_sample(url: str, prompt: Prompt) -> SemanticSample:
    """One sample's request sequence against the server at ``url`` (semblend or vanilla: the
    sequence is the same; a vanilla server reports no hook time and no semantic reuse)."""
    name, prompt_a, prompt_b, miss = prompt
    flush_cache(url)
    cold = stream_generate(url, prompt_a, ANSWER_TOKENS)
    semantic, semantic_hook_ms, reused = _hook_ms(
        url, lambda: stream_generate(url, prompt_b, ANSWER_TOKENS)
    )
    semantic_cached = int(semantic.meta.get("cached_tokens", 0)) + reused
    flush_cache(url)
    stream_generate(url, prompt_b[: max(semantic_cached, 1)], ANSWER_TOKENS)
    exact = stream_generate(url, prompt_b, ANSWER_TOKENS)
    miss_run, miss_hook_ms, _ = _hook_ms(url, lambda: stream_generate(url, miss, ANSWER_TOKENS))
    return SemanticSample(
        essay=name,
        prompt_tokens=len(prompt_b),
        cold_s=cold.ttft_s,
        semantic_s=semantic.ttft_s,
        semantic_cached=semantic_cached,
        exact_s=exact.ttft_s,
        exact_cached=int(exact.meta.get("cached_tokens", 0)),
        miss_s=miss_run.ttft_s,
        semantic_hook_ms=semantic_hook_ms,
        miss_hook_ms=miss_hook_ms,
    )


def run_interleaved(
    semblend_url: str, vanilla_url: str | None, prompts: list[Prompt]
) -> tuple[list[SemanticSample], list[SemanticSample]]:
    """Every sample on the semblend server and, right before or after it (alternating), the same
    sequence on the vanilla server: slow drifts of the machine hit both alike."""
    urls = [semblend_url] + ([vanilla_url] if vanilla_url else [])
    for url in urls:
        stream_generate(url, prompts[0][3], ANSWER_TOKENS)  # warm-up, not recorded
    semblend: list[SemanticSample] = []
    vanilla: list[SemanticSample] = []
    for i, prompt in enumerate(prompts):
        order = [(semblend_url, semblend)] + ([(vanilla_url, vanilla)] if vanilla_url else [])
        for url, out in order if i % 2 == 0 else reversed(order):
            out.append(run_sample(url, prompt))
    return semblend, vanilla


def _start(semblend: bool) -> Any:
    from ..model_prep import prepare_model
    from ..server import ServerSpec, start_healthy

    name = "semblend" if semblend else "vanilla"
    log = Path("bench-results") / f"semantic-{name}-server.log"
    env = {"SEMBLEND_ENABLED": "1" if semblend else "0"}
    (server,) = start_healthy([ServerSpec(prepare_model(), env=env, log_path=log)], timeout=300)
    return server


def _p50(values: list[float]) -> float:
    """p50 of ``values`` given in seconds, in milliseconds."""
    return percentile(values, 50) * 1000


@click.command("semantic")
@click.option("--url", default=None, help="A running semblend server (else one is started).")
@click.option("--doc-tokens", default=1500, show_default=True, type=click.IntRange(256, 8000))
@click.option("--samples", default=5, show_default=True, type=click.IntRange(1, 20))
@click.option(
    "--vanilla/--no-vanilla",
    default=True,
    help="Also start a vanilla server and run the same sequence on it (interleaved).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def command(
    url: str | None, doc_tokens: int, samples: int, vanilla: bool, json_path: Path | None
) -> None:
    """Semantic-hit TTFT vs cold and vs an exact hit of the same reused length; miss overhead."""
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    prompts = _prompts(doc_tokens, samples)
    servers = []
    try:
        if url is None:
            servers.append(_start(semblend=True))
            if vanilla:
                servers.append(_start(semblend=False))
        semblend_url = url or servers[0].url
        vanilla_url = servers[1].url if len(servers) > 1 else None
        results, vanilla_results = run_interleaved(semblend_url, vanilla_url, prompts)
    finally:
        for server in servers:
            server.stop()
    vanilla_miss = [s.miss_s for s in vanilla_results]
    summary = {
        "doc_tokens": doc_tokens,
        "samples": samples,
        "cold_ms_p50": _p50([s.cold_s for s in results]),
        "semantic_ms_p50": _p50([s.semantic_s for s in results]),
        "exact_same_length_ms_p50": _p50([s.exact_s for s in results]),
        "semantic_cached_tokens_mean": statistics.fmean(s.semantic_cached for s in results),
        "exact_cached_tokens_mean": statistics.fmean(s.exact_cached for s in results),
        "miss_semblend_ms_p50": _p50([s.miss_s for s in results]),
        "miss_vanilla_ms_p50": _p50(vanilla_miss) if vanilla_miss else None,
        "semantic_hook_ms_p50": percentile([s.semantic_hook_ms for s in results], 50),
        "miss_hook_ms_p50": percentile([s.miss_hook_ms for s in results], 50),
    }
    summary["semantic_over_exact"] = (
        summary["semantic_ms_p50"] / summary["exact_same_length_ms_p50"]
    )
    summary["speedup_over_cold"] = summary["cold_ms_p50"] / summary["semantic_ms_p50"]
    summary["miss_overhead_in_scheduler"] = summary["miss_hook_ms_p50"] / summary["cold_ms_p50"]
    if vanilla_miss:
        summary["vanilla_cold_ms_p50"] = _p50([s.cold_s for s in vanilla_results])
        summary["miss_overhead_ab"] = (
            summary["miss_semblend_ms_p50"] / summary["miss_vanilla_ms_p50"] - 1
        )
        summary["miss_overhead_ab_paired"] = (
            percentile(
                [s.miss_s / v.miss_s for s, v in zip(results, vanilla_results, strict=True)], 50
            )
            - 1
        )
    for key, value in summary.items():
        click.echo(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    if json_path is not None:
        write_report(
            json_path,
            summary=summary,
            samples=[asdict(s) for s in results],
            vanilla_samples=[asdict(s) for s in vanilla_results],
        )
        click.echo(f"wrote {json_path}")
