"""Benchmark ``adversarial``: provider lookups on token streams built to be slow, against the lookup
budget (``lookup_budget_ms``).

Streams (each a donor set and a query): one token repeated 100,000 times; a periodic sequence of
100,000 tokens; a 2,048-token document shared (after its own 16-token head) by 1,000 donors; a
100,000-token prompt whose donor differs in its first 16 tokens. Reports, per stream, the lookup
wall time (p50, p99 over repeats), the budget in work units and the decisions. The budget is
counted in work units, not measured, so a p99 above the budget means the per-step costs of
:mod:`semblend_sglang.lookup_budget` are optimistic for this machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from semblend_sglang.lookup_budget import LookupBudget

from .metrics import percentile
from .report import write_json

LONG = 100_000


@dataclass(frozen=True)
class Stream:
    """Donor token arrays and one query, as a named adversarial case."""

    name: str
    donors: tuple[np.ndarray, ...]
    query: np.ndarray


def repeated_token(n: int = LONG, token: int = 7) -> Stream:
    """One token repeated ``n`` times, in the donor and in the query."""
    return Stream("repeated_token", (np.full(n, token, dtype=np.int64),), np.full(n, token))


def periodic(n: int = LONG, period: int = 50, seed: int = 0) -> Stream:
    """A ``period``-token pattern repeated to ``n`` tokens; the query starts 5 tokens later."""
    rng = np.random.default_rng(seed)
    tile = rng.integers(1000, 30000, period)
    full = np.tile(tile, n // period + 2)
    return Stream("periodic", (full[:n],), full[5 : n + 5])


def shared_chunks(donors: int = 1000, doc: int = 2048, seed: int = 0) -> Stream:
    """One document behind ``donors`` different 16-token heads; the query has its own head."""
    rng = np.random.default_rng(seed)
    base = rng.integers(1000, 30000, doc)
    heads = [rng.integers(1000, 30000, 16) for _ in range(donors + 1)]
    return Stream(
        "shared_chunks",
        tuple(np.concatenate([h, base]) for h in heads[:-1]),
        np.concatenate([heads[-1], base]),
    )


def long_similar(n: int = LONG, seed: int = 0) -> Stream:
    """A ``n``-token prompt whose one donor differs in its first 16 tokens."""
    rng = np.random.default_rng(seed)
    base = rng.integers(1000, 30000, n)
    query = np.concatenate([rng.integers(1000, 30000, 16), base[16:]])
    return Stream("long_similar", (base,), query)


STREAMS: tuple[Callable[[], Stream], ...] = (repeated_token, periodic, shared_chunks, long_similar)


def run_stream(stream: Stream, repeats: int, budget_ms: float) -> dict[str, Any]:
    """Register the stream's donors in a fresh provider and time ``repeats`` lookups."""
    from prometheus_client import CollectorRegistry

    from semblend_sglang.config import Config
    from semblend_sglang.lookup_params import LookupParams
    from semblend_sglang.namespace import Namespace
    from semblend_sglang.provider import SemanticProvider

    config = Config(lookup_budget_ms=budget_ms, max_donors=max(20000, len(stream.donors)))
    provider = SemanticProvider(config, registry=CollectorRegistry())
    namespace = Namespace(model="adversarial")
    for handle, tokens in enumerate(stream.donors):
        provider.register(namespace, handle, tokens)
    times: list[float] = []
    decisions: dict[str, int] = {}
    for _ in range(repeats):
        started = time.perf_counter()
        decision = provider.lookup(LookupParams(namespace, stream.query, 0, None))
        times.append((time.perf_counter() - started) * 1e3)
        key = decision.kind if decision.kind != "decline" else f"decline:{decision.reason}"
        decisions[key] = decisions.get(key, 0) + 1
    return {
        "stream": stream.name,
        "query_tokens": int(stream.query.size),
        "donors": len(stream.donors),
        "budget_ms": budget_ms,
        "budget_units": LookupBudget(budget_ms).total,
        "lookup_ms_p50": percentile(times, 50),
        "lookup_ms_p99": percentile(times, 99),
        "decisions": decisions,
    }


@click.command()
@click.option("--repeats", default=50, show_default=True, help="Lookups per stream.")
@click.option("--budget-ms", default=5.0, show_default=True, help="lookup_budget_ms.")
@click.option("--json", "json_path", default=None, help="Write the results here.")
def command(repeats: int, budget_ms: float, json_path: str | None) -> None:
    """Lookup wall time on adversarial token streams against the lookup budget."""
    results = [run_stream(build(), repeats, budget_ms) for build in STREAMS]
    click.echo(f"{'stream':16} {'tokens':>8} {'donors':>6} {'p50 ms':>8} {'p99 ms':>8}  decisions")
    for r in results:
        click.echo(
            f"{r['stream']:16} {r['query_tokens']:8} {r['donors']:6} "
            f"{r['lookup_ms_p50']:8.2f} {r['lookup_ms_p99']:8.2f}  {r['decisions']}"
        )
    if json_path:
        write_json(json_path, results)
