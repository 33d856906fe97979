"""End to end: donor-aware dispatch in the real SGLang 0.5.23 server with ``--dp-size 2`` on CPU
(the controller process and two schedulers, one core each), hits confirmed by the server.

One server for the module, with SGLang's ``total_tokens`` method as the fallback: on idle ranks
it sends every request to rank 0, so a donor pinned to rank 1 (``routed_dp_rank``) is found by a
probe only if semblend sends the probe there, and a probe semblend leaves to SGLang lands on
rank 0 (no hit) — each test would fail without the feature, deterministically. Every hit is read
from the schedulers' own counters (``/semblend/snapshot``); SGLang's ``cached_tokens`` counts
exact prefix hits only.
"""

from __future__ import annotations

import ast
import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.server import SglangServer, http_json
from tests.harness.server import generate, healthy_server

pytestmark = pytest.mark.e2e

INDEX_BYTES = 1024 * 1024
DOC_TOKENS = 600
"""Tokens of each shared document: above semblend's 256-token minimum prompt, short enough
that a prefill on one core takes about a second."""
NEW_TOKENS = 4
"""Greedy output tokens of each request but the load fillers'."""
LOAD_MARGIN = 2048
HEADS = (
    "Summarize the following essay in three sentences.\n\n",
    "Read the essay below carefully and list the author's main arguments.\n\n",
    "You are an editor. Point out the weakest claim in this text.\n\n",
    "Write a title for the essay that follows.\n\n",
)


@pytest.fixture(scope="module")
def server(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    log = tmp_path_factory.mktemp("dp-server") / "server.log"
    args = ["--dp-size", "2", "--load-balance-method", "total_tokens"]
    env = {
        "SEMBLEND_ENABLED": "1",
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
        "SEMBLEND_DISPATCH_LOAD_MARGIN": str(LOAD_MARGIN),
        "SEMBLEND_DISPATCH_INDEX_BYTES": str(INDEX_BYTES),
    }
    with healthy_server(smollm2_model_dir, log, env, args) as srv:
        yield srv


@pytest.fixture(scope="module")
def enc(smollm2_tokenizer: Any) -> Any:
    return lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)


def _totals(url: str) -> dict[str, Any]:
    snap = http_json(url + "/semblend/snapshot")
    assert len(snap["ranks"]) == 2 and all(snap["ranks"])  # both schedulers run semblend
    total: dict[str, Any] = snap["total"]
    return total


def _materialized(url: str) -> int:
    return int(_totals(url)["outcomes"]["materialized"])


def _reused(url: str) -> int:
    """Tokens the schedulers copied from donors so far, kept or recomputed by the recompute
    budget (SGLang's ``cached_tokens`` counts exact hits only)."""
    total = _totals(url)
    return int(total["reused_tokens"]) + int(total.get("recomputed_tokens", 0))


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["meta_info"]["cached_tokens"])


def _dispatch_stats(server: SglangServer) -> list[dict[str, int]]:
    assert server.log_path is not None
    text = server.log_path.read_text(errors="replace")
    return [ast.literal_eval(m) for m in re.findall(r"semblend dispatch: (\{[^}]*\})", text)]


def test_a_probe_is_sent_to_its_donors_rank_and_materializes(
    server: SglangServer, enc: Any, essay_texts: list[str]
) -> None:
    doc = enc(essay_texts[0])[:DOC_TOKENS]
    donor = generate(server.url, enc(HEADS[0]) + doc, NEW_TOKENS, routed_dp_rank=1)
    assert _cached(donor) < 50
    for head in HEADS[1:3]:
        before, reused = _materialized(server.url), _reused(server.url)
        probe = generate(server.url, enc(head) + doc, NEW_TOKENS)
        assert _materialized(server.url) == before + 1
        assert _reused(server.url) - reused >= 0.9 * len(doc)
        assert _cached(probe) < 50  # reuse is not client-visible


def test_a_pinned_request_stays_pinned(
    server: SglangServer, enc: Any, essay_texts: list[str]
) -> None:
    doc = enc(essay_texts[1])[:DOC_TOKENS]
    generate(server.url, enc(HEADS[0]) + doc, NEW_TOKENS, routed_dp_rank=1)
    before = _materialized(server.url)
    pinned = generate(server.url, enc(HEADS[1]) + doc, NEW_TOKENS, routed_dp_rank=0)
    assert _cached(pinned) < 50 and _materialized(server.url) == before
    # the same probe pinned to the donor's rank hits: the miss above was the pin's doing
    reused = _reused(server.url)
    generate(server.url, enc(HEADS[2]) + doc, NEW_TOKENS, routed_dp_rank=1)
    assert _reused(server.url) - reused >= 0.9 * len(doc)


def test_a_heavily_loaded_donor_rank_is_skipped(
    server: SglangServer, enc: Any, essay_texts: list[str]
) -> None:
    doc = enc(essay_texts[2])[:DOC_TOKENS]
    generate(server.url, enc(HEADS[0]) + doc, NEW_TOKENS, routed_dp_rank=1)
    fillers = [enc(essay_texts[20 + i])[:1200] for i in range(3)]
    overloaded_before = max((s.get("overloaded", 0) for s in _dispatch_stats(server)), default=0)
    with ThreadPoolExecutor(max_workers=3) as pool:
        # ~3,600 prompt tokens pinned to rank 1: the controller counts them at once
        load = [pool.submit(generate, server.url, ids, 8, routed_dp_rank=1) for ids in fillers]
        time.sleep(1.0)  # the fillers reach the controller first
        before = _materialized(server.url)
        probe = generate(server.url, enc(HEADS[1]) + doc, NEW_TOKENS)
        for f in load:
            f.result()
    assert _cached(probe) < 50 and _materialized(server.url) == before  # went to rank 0
    stats = _dispatch_stats(server)
    assert max(s.get("overloaded", 0) for s in stats) == overloaded_before + 1


@pytest.mark.parametrize("field", ["cache_salt", "extra_key"])
def test_dispatch_never_crosses_namespaces(
    server: SglangServer, enc: Any, essay_texts: list[str], field: str
) -> None:
    doc = enc(essay_texts[3 if field == "cache_salt" else 4])[:DOC_TOKENS]
    generate(server.url, enc(HEADS[0]) + doc, NEW_TOKENS, routed_dp_rank=1, **{field: "tenant-a"})
    before = _materialized(server.url)
    other = generate(server.url, enc(HEADS[1]) + doc, NEW_TOKENS, **{field: "tenant-b"})
    assert _cached(other) < 50 and _materialized(server.url) == before
    reused = _reused(server.url)
    generate(server.url, enc(HEADS[2]) + doc, NEW_TOKENS, **{field: "tenant-a"})
    assert _reused(server.url) - reused >= 0.9 * len(doc)
    assert _materialized(server.url) == before + 1


def test_the_controller_stays_within_its_byte_bound_without_errors(server: SglangServer) -> None:
    stats = _dispatch_stats(server)
    assert stats, "the controller logged no dispatch statistics"
    assert all(s["max_bytes"] == INDEX_BYTES for s in stats)
    assert all(0 < s["charged_bytes"] <= INDEX_BYTES for s in stats)
    assert all(s["errors"] == 0 for s in stats)
    assert stats[-1]["entries"] >= 5 and stats[-1]["donor"] >= 3
    assert server.alive()


def test_a_cache_flush_empties_the_controllers_index(server: SglangServer) -> None:
    """Runs last: ``/flush_cache`` reaches the ranks through the controller, which forgets
    every donor it remembered (their KV is gone)."""
    assert _dispatch_stats(server)[-1]["entries"] > 0
    with urllib.request.urlopen(
        urllib.request.Request(server.url + "/flush_cache", data=b"", method="POST"), timeout=120
    ) as resp:
        assert resp.status == 200
    deadline = time.monotonic() + 60
    while not any(s.get("flushes") for s in _dispatch_stats(server)):
        assert time.monotonic() < deadline, "the controller logged no flush"
        time.sleep(0.5)
    last = [s for s in _dispatch_stats(server) if s.get("flushes")][-1]
    assert last["entries"] == 0 and last["errors"] == 0
