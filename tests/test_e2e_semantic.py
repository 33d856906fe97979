"""End to end: semantic reuse in the real SGLang 0.5.23 server on CPU (plugin in the spawned
scheduler), read back from the server's own counters on /metrics.

SGLang checks its pools when idle (free + used == size, request rows, tree sanity) and raises on a
leak (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, on by default): a server that is still healthy
after idling is a server whose invariants held.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from semblend_sglang.server import SglangServer, http_json
from tests.conftest import REPO_ROOT
from tests.harness.server import (
    copied_tokens,
    generate,
    outcome_count,
    semblend_metrics,
    semblend_totals,
)

pytestmark = pytest.mark.e2e

INSTRUCTIONS = (
    "Summarize the following essay in three sentences.\n\n",
    "Read the essay below carefully and list the author's main arguments.\n\n",
    "You are an editor. Point out the weakest claim in this text.\n\n",
    "Write a title for the essay that follows.\n\n",
)


@pytest.fixture
def server(semblend_server: SglangServer) -> SglangServer:
    """The session's shared semblend server (tests/conftest.py)."""
    return semblend_server


def test_changed_instruction_reuses_the_shared_document(
    server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    enc = smollm2_tokenizer.encode
    doc = enc(essay_texts[0], add_special_tokens=False)[:1100]
    assert len(doc) >= 1000
    first = generate(server.url, enc(INSTRUCTIONS[0], add_special_tokens=False) + doc, 8)
    before = semblend_metrics(server.url)
    target = enc(INSTRUCTIONS[1], add_special_tokens=False) + doc
    second = generate(server.url, target, 16)
    after = semblend_metrics(server.url)
    reused = copied_tokens(after) - copied_tokens(before)
    assert reused >= 0.9 * len(doc), (reused, len(doc))
    assert after["semblend_recomputed_tokens_total"] > before.get(
        "semblend_recomputed_tokens_total", 0
    )  # the default recompute budget spent some of it
    assert outcome_count(after, "materialized") - outcome_count(before, "materialized") == 1
    # reuse at another offset is not client-visible: SGLang reports its exact prefix only
    assert second["meta_info"]["cached_tokens"] < 50
    assert second["meta_info"]["completion_tokens"] == 16 and second["text"]
    assert first["meta_info"]["cached_tokens"] < 50
    # The same prompt computed cold (another cache_salt: no donor, no exact prefix) answers the
    # same first tokens; the reused document KV attended to another instruction, so greedy
    # decoding may part later (measured per workload by the bench: docs/perf.md).
    cold = generate(server.url, target, 16, cache_salt="cold")
    assert cold["meta_info"]["cached_tokens"] == 0
    got, want = second["output_ids"], cold["output_ids"]
    agree = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), 16)
    assert agree >= 4, (got, want)

    # An exact repeat is not served from the approximate KV: had it been published, the exact
    # prefix would cover the prompt and the provider would route it as "exact".
    repeat = generate(server.url, target, 8)
    final = semblend_metrics(server.url)
    assert outcome_count(final, "exact") == outcome_count(after, "exact")
    assert outcome_count(final, "materialized") == outcome_count(after, "materialized") + 1
    assert repeat["meta_info"]["cached_tokens"] < 50


def test_sixteen_concurrent_mixed_requests_complete_and_pools_stay_consistent(
    server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    enc = smollm2_tokenizer.encode
    docs = [enc(essay_texts[i], add_special_tokens=False)[:700] for i in (1, 2, 3)]
    heads = [enc(t, add_special_tokens=False) for t in INSTRUCTIONS]
    for doc in docs:  # donors
        generate(server.url, heads[0] + doc, 2)
    prompts = []
    for i in range(16):
        doc = docs[i % 3]
        if i % 4 == 3:
            prompts.append(enc(essay_texts[10 + i], add_special_tokens=False)[:400])  # no donor
        else:
            prompts.append(heads[1 + i % 3] + doc)
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda ids: generate(server.url, ids, 6), prompts))
    assert all(r["meta_info"]["completion_tokens"] == 6 for r in results)
    assert outcome_count(semblend_metrics(server.url), "materialized") >= 3
    time.sleep(1)  # idle: the scheduler runs its strict pool/tree checks on its first idle loop
    with urllib.request.urlopen(server.url + "/health_generate", timeout=120) as resp:
        assert resp.status == 200  # the scheduler still runs a forward after its idle checks
    # Exact caching still works and is exact: a repeat of a donor hits and decodes the same.
    donor = heads[0] + docs[0]
    a = generate(server.url, donor, 8)
    b = generate(server.url, donor, 8)
    assert b["meta_info"]["cached_tokens"] >= len(donor) - 1
    assert a["text"] == b["text"]
    assert server.alive()
    assert "memory leak" not in server.log_tail(4000)


def test_a_passage_computed_after_a_reused_one_is_reused_from_the_held_donor(
    server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    """A request that reused passage A computes passage C after it: C's KV is approximate, so
    it never enters the tree, but the finished request holds it as donor KV. A later request
    with C (after another instruction) reuses it from there and answers like a cold run of the
    same prompt; SGLang's idle checks pass with the held slots."""
    enc = smollm2_tokenizer.encode
    doc_a = enc(essay_texts[4], add_special_tokens=False)[:500]
    doc_c = enc(essay_texts[5], add_special_tokens=False)[:500]
    heads = [enc(t, add_special_tokens=False) for t in INSTRUCTIONS]
    generate(server.url, heads[0] + doc_a, 2)
    before = semblend_metrics(server.url)
    generate(server.url, heads[1] + doc_a + doc_c, 2)  # reuses A, computes C
    middle = semblend_metrics(server.url)
    assert outcome_count(middle, "materialized") - outcome_count(before, "materialized") == 1
    held = semblend_totals(server.url)["held_donors"]
    assert held["kept"] >= 1 and held["tokens"] >= len(doc_c), held

    probe = heads[2] + doc_c + heads[3]
    got = generate(server.url, probe, 16)
    after = semblend_metrics(server.url)
    reused = copied_tokens(after) - copied_tokens(middle)
    assert reused >= 0.9 * len(doc_c), (reused, len(doc_c))
    assert semblend_totals(server.url)["held_donors"]["matched"] > held["matched"]
    cold = generate(server.url, probe, 16, cache_salt="cold-held")
    assert cold["meta_info"]["cached_tokens"] == 0
    a, b = got["output_ids"], cold["output_ids"]
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 16)
    assert agree >= 4, (a, b)
    time.sleep(1)  # idle: the scheduler runs its strict pool/tree checks on its first idle loop
    with urllib.request.urlopen(server.url + "/health_generate", timeout=120) as resp:
        assert resp.status == 200
    assert server.alive()
    assert "memory leak" not in server.log_tail(4000)


def test_a_request_that_opts_out_is_served_cold_on_both_apis(
    server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    """``custom_params: {"semblend_reuse": false}`` (``/generate``) or ``"off"`` (the
    OpenAI-compatible API's ``extra_body``): no reuse although a donor is there, counted as
    ``declined:opted_out``, and the answer is the cold run's."""
    enc = smollm2_tokenizer.encode
    doc = enc(essay_texts[6], add_special_tokens=False)[:900]
    generate(server.url, enc(INSTRUCTIONS[0], add_special_tokens=False) + doc, 8)  # the donor
    target = enc(INSTRUCTIONS[2], add_special_tokens=False) + doc
    before = semblend_metrics(server.url)
    off = generate(server.url, target, 16, custom_params={"semblend_reuse": False})
    after = semblend_metrics(server.url)
    opted = 'semblend_declined_total{reason="opted_out"}'
    assert after[opted] - before.get(opted, 0.0) == 1
    assert outcome_count(after, "materialized") == outcome_count(before, "materialized")
    assert copied_tokens(after) == copied_tokens(before)  # nothing read from the donor
    cold = generate(server.url, target, 16, cache_salt="opt-out-cold")
    assert cold["meta_info"]["cached_tokens"] == 0
    assert off["output_ids"] == cold["output_ids"]

    (model,) = [m["id"] for m in http_json(server.url + "/v1/models")["data"]]
    body = {
        "model": model,
        "prompt": target,
        "max_tokens": 4,
        "temperature": 0,
        "custom_params": {"semblend_reuse": "off"},  # what extra_body adds to the JSON
    }
    answer = http_json(server.url + "/v1/completions", body)
    assert answer["choices"][0]["text"]
    assert semblend_metrics(server.url)[opted] - after[opted] == 1
    # without the key a request of the same kind reuses the donor (not ``target`` itself:
    # the opted-out requests were served cold and published it as an exact prefix)
    plain = semblend_metrics(server.url)
    other = enc(INSTRUCTIONS[3], add_special_tokens=False) + doc
    http_json(server.url + "/v1/completions", {**body, "prompt": other, "custom_params": None})
    assert (
        outcome_count(semblend_metrics(server.url), "materialized")
        == outcome_count(plain, "materialized") + 1
    )
    # an object of repair settings is "on" with those settings, on this API too
    before_fast = semblend_totals(server.url)["by_settings"].get("fast", {})
    fast = {"semblend_reuse": {"preset": "fast"}}
    third = enc("Name the essay's topic in one word.\n\n", add_special_tokens=False) + doc
    http_json(server.url + "/v1/completions", {**body, "prompt": third, "custom_params": fast})
    after_fast = semblend_totals(server.url)["by_settings"]["fast"]
    assert after_fast["materialized"] == before_fast.get("materialized", 0) + 1


ONLY_AFTER_FIRST_EVENT = frozenset({"semblend_errors_total"})
"""Series of the dashboard with an open label set (``where``): exported from their first
increment on, which a healthy server never makes. The test checks them against the declared
series instead (telemetry.SERIES)."""


def test_every_grafana_panel_reads_series_the_server_exports(server: SglangServer) -> None:
    from semblend_sglang.telemetry import SERIES

    dashboard = json.loads((REPO_ROOT / "docs" / "grafana-semblend.json").read_text())
    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    exported = {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    declared = set(SERIES.values())
    seen: set[str] = set()
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        names = {n for e in exprs for n in re.findall(r"\b(?:semblend_|sglang:)[A-Za-z0-9_:]+", e)}
        assert names, panel["title"]
        for name in names:
            seen.add(name)
            if name in ONLY_AFTER_FIRST_EVENT:
                assert name in declared, (panel["title"], name)
            else:
                assert name in exported, (panel["title"], name)
    # the dashboard covers hit rate, reused tokens, outcomes by reason, lookup and copy time
    for needed in (
        "semblend_requests_total",
        "semblend_reused_tokens_total",
        "semblend_declined_total",
        "semblend_lookup_seconds_bucket",
        "semblend_copy_seconds_bucket",
    ):
        assert needed in seen, needed


def _prefill_passes(server: SglangServer) -> int:
    """Prefill forward passes the server has logged so far (one ``Prefill batch`` line each)."""
    assert server.log_path is not None
    return server.log_path.read_text(errors="replace").count("Prefill batch")


def test_a_long_semantic_hit_is_one_prefill_pass_where_cold_takes_two(
    server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    """SGLang's default chunked prefill on CPU cuts at 4,096 tokens: a cold 7,000-token prompt
    takes two forward passes, the same prompt as a semantic hit (another instruction over the
    donor's document) one, since admission charges it the positions it computes; it answers
    like the cold run."""
    from semblend_sglang.bench.builtin_workloads import build_workload

    group = build_workload("cross_instruction", smollm2_tokenizer, essay_texts, 7000, 1, 5).groups[
        0
    ]
    donor, probe = group.donors[0].prompt_ids, group.probes[0].prompt_ids
    generate(server.url, donor, 1)
    before, passes = semblend_totals(server.url), _prefill_passes(server)
    reused = generate(server.url, probe, 8)
    hit_passes = _prefill_passes(server) - passes
    after = semblend_totals(server.url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1, after
    assert after["reused_tokens"] - before["reused_tokens"] >= 3000, after
    passes = _prefill_passes(server)
    cold = generate(server.url, probe, 8, cache_salt="long-cold")
    assert cold["meta_info"]["cached_tokens"] == 0
    assert (hit_passes, _prefill_passes(server) - passes) == (1, 2)
    got, want = reused["output_ids"], cold["output_ids"]
    agree = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))
    assert agree >= 4, (got, want)
