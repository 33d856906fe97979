"""The ``semantic`` bench job: semantic-hit TTFT beside cold and an exact hit of the same length.

One SGLang server with semblend enabled. Per sample (a different real essay each, cut to
``--doc-tokens`` SmolLM2 tokens), after ``/flush_cache``:

- cold: instruction A + document (this request becomes the donor);
- semantic: instruction B + document (the server reuses the donor's KV for the document);
- exact: the cache is flushed, the first ``c`` tokens of the semantic prompt are sent on their own,
  then the semantic prompt again, where ``c`` is the semantic request's ``cached_tokens`` — an
  exact prefix hit of the same reused length, SGLang's own best case;
- miss: a prompt of the same length from an essay no request has used (no donor): its TTFT is
  compared with a vanilla server's (``--vanilla`` starts one after the semblend server) for the
  miss overhead.

All TTFTs are streaming, greedy; reuse is read from the server's ``cached_tokens``.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from .ttft import flush_cache, stream_generate, write_report

INSTRUCTION_A = "Summarize the following essay in three sentences.\n\n"
INSTRUCTION_B = "Read the essay below carefully and list the author's main arguments.\n\n"


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


def run_semantic(url: str, prompts: list[tuple[str, list[int], list[int], list[int]]]) -> list:
    """Measure every sample against a semblend server at ``url``."""
    stream_generate(url, prompts[0][3])  # warm-up, not recorded
    samples = []
    for name, prompt_a, prompt_b, miss in prompts:
        flush_cache(url)
        cold_s, _ = stream_generate(url, prompt_a)
        semantic_s, meta = stream_generate(url, prompt_b)
        semantic_cached = int(meta.get("cached_tokens", 0))
        flush_cache(url)
        stream_generate(url, prompt_b[: max(semantic_cached, 1)])
        exact_s, meta_exact = stream_generate(url, prompt_b)
        miss_s, _ = stream_generate(url, miss)
        samples.append(
            SemanticSample(
                essay=name,
                prompt_tokens=len(prompt_b),
                cold_s=cold_s,
                semantic_s=semantic_s,
                semantic_cached=semantic_cached,
                exact_s=exact_s,
                exact_cached=int(meta_exact.get("cached_tokens", 0)),
                miss_s=miss_s,
            )
        )
    return samples


def run_misses(url: str, prompts: list[tuple[str, list[int], list[int], list[int]]]) -> list[float]:
    """TTFT of the miss prompts on a (vanilla) server at ``url``, same order as the semblend run."""
    stream_generate(url, prompts[0][3])
    out = []
    for _, _, _, miss in prompts:
        flush_cache(url)
        out.append(stream_generate(url, miss)[0])
    return out


def _start(semblend: bool) -> Any:
    from ..model_prep import prepare_model
    from ..server import free_port, start_server

    name = "semblend" if semblend else "vanilla"
    log = Path("bench-results") / f"semantic-{name}-server.log"
    env = {"SEMBLEND_ENABLED": "1" if semblend else "0"}
    server = start_server(prepare_model(), port=free_port(), env=env, log_path=log)
    server.wait_healthy()
    return server


def _p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


@click.command("semantic")
@click.option("--url", default=None, help="A running semblend server (else one is started).")
@click.option("--doc-tokens", default=1500, show_default=True, type=click.IntRange(256, 8000))
@click.option("--samples", default=5, show_default=True, type=click.IntRange(1, 20))
@click.option(
    "--vanilla/--no-vanilla", default=True, help="Also start a vanilla server for misses."
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def command(
    url: str | None, doc_tokens: int, samples: int, vanilla: bool, json_path: Path | None
) -> None:
    """Semantic-hit TTFT vs cold and vs an exact hit of the same reused length; miss overhead."""
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    prompts = _prompts(doc_tokens, samples)
    server = None if url is not None else _start(semblend=True)
    try:
        results = run_semantic(url or server.url, prompts)
    finally:
        if server is not None:
            server.stop()
    vanilla_miss: list[float] = []
    if vanilla and url is None:
        server = _start(semblend=False)
        try:
            vanilla_miss = run_misses(server.url, prompts)
        finally:
            server.stop()
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
    }
    summary["semantic_over_exact"] = (
        summary["semantic_ms_p50"] / summary["exact_same_length_ms_p50"]
    )
    summary["speedup_over_cold"] = summary["cold_ms_p50"] / summary["semantic_ms_p50"]
    if vanilla_miss:
        summary["miss_overhead"] = (
            summary["miss_semblend_ms_p50"] / summary["miss_vanilla_ms_p50"] - 1
        )
    for key, value in summary.items():
        click.echo(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    if json_path is not None:
        write_report(
            json_path,
            summary=summary,
            samples=[asdict(s) for s in results],
            vanilla_miss_s=vanilla_miss,
        )
        click.echo(f"wrote {json_path}")
