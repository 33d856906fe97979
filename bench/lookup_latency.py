"""Bench job ``provider``: lookup latency and index memory of the SemanticProvider.

Donors are 4,096-token windows of the 49 real essays (SmolLM2 tokenizer), each behind one of a few
instruction-like prefixes, at many offsets; the engine is emulated by a token source that rebuilds
a donor's tokens from (prefix, offset), so the index holds only hashes and handles. Queries are
4,096-token prompts at other offsets behind a prefix no donor has. Reports, per donor count:
lookup p50/p99 (first lookup of each request; exact_len 0; page size 1), plans found, mean reused
tokens, index bytes per donor (tracemalloc delta of building the index / donors, and the index's
own accounting), and registration time.
"""

from __future__ import annotations

import os
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from .metrics import percentile
from .report import cpu_model, write_json

PROMPT_TOKENS = 4096
DONOR_COUNTS = (1_000, 10_000, 100_000)
QUERIES = 300
DONOR_PREFIXES = (
    "Summarize the following essay in three sentences.",
    "Read the essay below and list its main arguments.",
    "You are a careful editor. Point out unclear passages in this text.",
    "Answer questions about the following document.",
    "Translate the key ideas of this essay into plain language.",
    "Write a short critique of the essay that follows.",
    "Extract every claim about startups from the text below.",
    "Explain the author's reasoning step by step.",
)
QUERY_PREFIX = "Using only the essay below, what does the author recommend to founders, and why?"


@dataclass(frozen=True)
class Corpus:
    """Token ids of the concatenated essays and of the prefixes."""

    text: np.ndarray
    donor_prefixes: tuple[np.ndarray, ...]
    query_prefix: np.ndarray
    prompt_tokens: int = PROMPT_TOKENS
    """Tokens of every donor and query prompt."""

    def donor_offset(self, handle: int) -> int:
        """Deterministic essay offset of donor ``handle`` (spread over the whole corpus)."""
        span = self.text.size - self.prompt_tokens
        return (handle * 7919) % span

    def donor_tokens(self, handle: int) -> np.ndarray:
        """Tokens of donor ``handle``: one of the prefixes, then essay text, ``prompt_tokens`` in
        all."""
        prefix = self.donor_prefixes[handle % len(self.donor_prefixes)]
        start = self.donor_offset(handle)
        body = self.text[start : start + self.prompt_tokens - prefix.size]
        return np.concatenate([prefix, body])

    def query_tokens(self, i: int) -> np.ndarray:
        """Query ``i``: the query prefix, then essay text at an offset no donor starts at."""
        span = self.text.size - self.prompt_tokens
        start = (i * 104729 + 13) % span
        body = self.text[start : start + self.prompt_tokens - self.query_prefix.size]
        return np.concatenate([self.query_prefix, body])


def load_corpus(prompt_tokens: int = PROMPT_TOKENS) -> Corpus:
    """Tokenize the essays and prefixes with the prepared SmolLM2 tokenizer (offline); prompts
    of ``prompt_tokens`` tokens."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoTokenizer

    from ..data import essay_texts
    from ..model_prep import prepared_model_dir

    tokenizer = AutoTokenizer.from_pretrained(prepared_model_dir())

    def encode(text: str) -> np.ndarray:
        return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    text = np.concatenate([encode(t + "\n\n") for t in essay_texts()])
    return Corpus(
        text=text,
        donor_prefixes=tuple(encode(p + "\n\n") for p in DONOR_PREFIXES),
        query_prefix=encode(QUERY_PREFIX + "\n\n"),
        prompt_tokens=prompt_tokens,
    )


def run_case(corpus: Corpus, donors: int, queries: int) -> dict[str, Any]:
    """Register ``donors`` donors, then time ``queries`` lookups. Returns one result row. The
    provider's settings are the defaults with any ``SEMBLEND_*`` variables applied (for side by
    side runs of other settings)."""
    import dataclasses

    from prometheus_client import CollectorRegistry

    from ..config import Config
    from ..lookup_params import LookupParams
    from ..namespace import Namespace
    from ..provider import SemanticProvider

    namespace = Namespace("SmolLM2-135M-Instruct", "bench")
    config = dataclasses.replace(Config.from_env(), max_donors=donors)
    donor_inputs = [corpus.donor_tokens(h) for h in range(min(donors, 64))]

    def token_source(handle: Any) -> np.ndarray:
        return corpus.donor_tokens(int(handle))

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    provider = SemanticProvider(config, token_source, registry=CollectorRegistry())
    started = time.perf_counter()
    for handle in range(donors):
        tokens = donor_inputs[handle] if handle < len(donor_inputs) else corpus.donor_tokens(handle)
        provider.register(namespace, handle, tokens)
        del tokens
    register_s = time.perf_counter() - started
    del donor_inputs
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(provider.index) == donors, "index lost donors"

    query_tokens = [corpus.query_tokens(i) for i in range(queries)]
    for i in range(5):  # warm-up (first-touch of caches), not timed
        provider.lookup(LookupParams(namespace, query_tokens[i], 0, f"warm-{i}"))
    times_ms: list[float] = []
    plans = 0
    reused = 0
    for i, tokens in enumerate(query_tokens):
        t0 = time.perf_counter_ns()
        decision = provider.lookup(LookupParams(namespace, tokens, 0, f"q-{i}"))
        times_ms.append((time.perf_counter_ns() - t0) / 1e6)
        if decision.plan is not None:
            plans += 1
            reused += decision.plan.reused_tokens
        provider.release(f"q-{i}")
    t0 = time.perf_counter_ns()
    repeat_n = 1000
    for _ in range(repeat_n):
        provider.lookup(LookupParams(namespace, query_tokens[0], 0, "warm-0"))
    repeat_us = (time.perf_counter_ns() - t0) / 1e3 / repeat_n
    stats = provider.index.stats()
    return {
        "donors": donors,
        "queries": queries,
        "lookup_ms_p50": round(percentile(times_ms, 50), 4),
        "lookup_ms_p99": round(percentile(times_ms, 99), 4),
        "lookup_ms_max": round(max(times_ms), 4),
        "repeat_lookup_us": round(repeat_us, 3),
        "plans": plans,
        "mean_reused_tokens": round(reused / plans, 1) if plans else 0.0,
        "bytes_per_donor": round(traced / donors, 1),
        "index_accounted_bytes_per_donor": round(provider.index.nbytes() / donors, 1),
        "postings_per_donor": round(stats["live_postings"] / donors, 1),
        "register_s": round(register_s, 2),
        "register_us_per_donor": round(1e6 * register_s / donors, 1),
    }


def _machine() -> str:
    """The CPU model and core count, e.g. ``"AMD EPYC 7B13 x2"``."""
    return f"{cpu_model()} x{os.cpu_count()}"


@click.command(name="provider")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the results as JSON to this path.",
)
@click.option(
    "--donors",
    "donor_counts",
    type=int,
    multiple=True,
    help="Donor counts to run (default: 1000, 10000, 100000).",
)
@click.option(
    "--queries", type=int, default=QUERIES, show_default=True, help="Timed lookups per donor count."
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(256, 65536),
    default=PROMPT_TOKENS,
    show_default=True,
    help="Tokens of every donor and query prompt.",
)
def command(
    json_path: str | None, donor_counts: tuple[int, ...], queries: int, prompt_tokens: int
) -> None:
    """Lookup latency (p50/p99) and index bytes per donor for prompts of real text (4,096
    tokens unless --prompt-tokens)."""
    counts = donor_counts or DONOR_COUNTS
    corpus = load_corpus(prompt_tokens)
    click.echo(
        f"corpus: {corpus.text.size} essay tokens; prompts of {prompt_tokens} tokens; "
        f"machine: {_machine()}"
    )
    rows = []
    for donors in counts:
        row = run_case(corpus, donors, queries)
        rows.append(row)
        click.echo(
            f"donors={donors:>7}  p50={row['lookup_ms_p50']:.3f} ms  "
            f"p99={row['lookup_ms_p99']:.3f} ms  bytes/donor={row['bytes_per_donor']:.0f}  "
            f"plans={row['plans']}/{queries}  register={row['register_s']:.1f} s"
        )
    header = (
        "| donors | lookup p50 ms | lookup p99 ms | max ms | repeat us | plans | mean reused |"
        " bytes/donor (tracemalloc) | bytes/donor (accounted) | register us/donor |"
    )
    click.echo("\n" + header)
    click.echo("|" + "---|" * 10)
    for r in rows:
        click.echo(
            f"| {r['donors']:,} | {r['lookup_ms_p50']:.3f} | {r['lookup_ms_p99']:.3f} | "
            f"{r['lookup_ms_max']:.3f} | {r['repeat_lookup_us']:.2f} | {r['plans']}/{r['queries']}"
            f" | {r['mean_reused_tokens']:.0f} | {r['bytes_per_donor']:.0f} | "
            f"{r['index_accounted_bytes_per_donor']:.0f} | {r['register_us_per_donor']:.0f} |"
        )
    if json_path:
        payload = {
            "bench": "provider",
            "machine": _machine(),
            "prompt_tokens": prompt_tokens,
            "results": {str(r["donors"]): r for r in rows},
        }
        write_json(json_path, payload)
        click.echo(f"wrote {json_path}")
