"""The load bench's schedule and summary (bench/load.py); the servers' side is
exercised by running ``python -m semblend_sglang.bench load`` (docs/perf.md)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from semblend_sglang.bench.load import (
    MIXED_WORKLOADS,
    PassResult,
    build_mixes,
    poisson_schedule,
    summarize,
)


def test_the_schedule_is_a_seeded_poisson_process_with_every_nth_dropped() -> None:
    prompts = [(i, i + 1) for i in range(2000)]
    a = poisson_schedule(prompts, rate=2.0, abort_every=10, seed=3)
    assert a == poisson_schedule(prompts, rate=2.0, abort_every=10, seed=3)
    gaps = np.diff([0.0] + [s.at_s for s in a])
    assert all(g > 0 for g in gaps)
    assert abs(gaps.mean() - 0.5) < 0.05 and abs(gaps.std() - 0.5) < 0.07  # exponential, 1/rate
    assert [i for i, s in enumerate(a) if s.drop] == list(range(9, 2000, 10))
    assert not any(s.drop for s in poisson_schedule(prompts, 2.0, 0, 3))
    assert [s.prompt_ids for s in a] == prompts


def test_summary_reports_throughput_percentiles_and_errors() -> None:
    result = PassResult(ttft_ms=[float(x) for x in range(1, 101)], tokens=5000, seconds=50.0)
    result.errors, result.aborted, result.flushes = 1, 3, 1
    got = summarize(result)
    assert got["throughput_rps"] == pytest.approx(2.0)
    assert got["tokens_per_s"] == pytest.approx(100.0)
    assert got["ttft_ms_p50"] == pytest.approx(50.5) and got["ttft_ms_p99"] == pytest.approx(99.01)
    assert (got["errors"], got["aborted"], got["flushes"]) == (1, 3, 1)


def test_mixes_hold_misses_and_the_workloads_groups(
    smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    mixes = build_mixes(smollm2_tokenizer, essay_texts, 512, 30, seed=0)
    assert len(mixes["miss"]) == len(mixes["mixed"]) == 30
    assert len(set(mixes["miss"])) == 30  # no miss repeats another
    shared = set(mixes["mixed"]) & set(mixes["miss"])
    assert 0 < len(shared) < 30  # misses interleaved with the workloads' requests
    assert len(MIXED_WORKLOADS) >= 4
