"""End to end: SGLang's own KV canary in the real CPU server with semblend on. The shared
semblend server (tests/conftest.py ``semblend_server``) runs with ``--kv-canary raise`` (its CPU
stand-ins: semblend_sglang/cpu_runtime/canary_shim.py), so every test on it is verified by the
canary; this one sends the hits whose slots the recorder (patches/sglang/engine/kv_canary_record.py)
must write for the canary. Under the default settings a one-span hit is a sparse extend checked
at the check layer, and a plan of two spans computes every copied position up to the check
layer (dense) and then shrinks; every later forward verifies each request's slots, and a
violation raises in the scheduler (the server dies). Without the recorder the server dies at
the first hit: tried by hand, docs/sglang.md "SGLang's KV canary".

The test empties the shared server's cache first (``/flush_cache``, between modules, when no
request runs): with the pool full of earlier modules' evictable prompts, the two-span hit's
best donor is the one-span hit, whose KV is held outside the tree, and the hit's own allocation
frees it before the copy, so the hit declines as ``donor_evicted`` (measured: 1 of 2
materialized after test_e2e_kl, 2 of 2 on an empty pool; docs/sglang.md, the held donors).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from semblend_sglang.bench.client import flush_cache, health_generate
from semblend_sglang.server import SglangServer
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e


def _counts(totals: dict[str, Any]) -> dict[str, int]:
    """The counters this test reads, flat: materialized hits, reused spans, check-layer
    recomputes, the canary's recorded batches and semblend's errors (all kinds)."""
    return {
        "materialized": int(totals["outcomes"].get("materialized", 0)),
        "reused_spans": int(totals["reused_spans"]),
        "recompute_checks": int(totals["recompute_checks"]),
        "canary_batches": int(totals["kv_canary_recorded"]["batches"]),
        "errors": sum(int(n) for n in totals["errors"].values()),
    }


def test_semantic_hits_pass_sglang_s_kv_canary(
    semblend_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    def enc(text: str) -> list[int]:
        return list(smollm2_tokenizer.encode(text, add_special_tokens=False))

    url, salt = semblend_server.url, f"canary-{uuid.uuid4().hex}"
    doc = enc(essay_texts[3])[:600]
    asked = enc("List the main arguments of the essay below.\n\n")
    flush_cache(url)
    before = _counts(semblend_totals(url))
    generate(url, enc("Summarize the following essay.\n\n") + doc, 8, cache_salt=salt)
    one_span = generate(url, asked + doc, 16, cache_salt=salt)
    two_spans = generate(url, asked + doc[:300] + enc(" (sic)") + doc[300:], 16, cache_salt=salt)
    after = _counts(semblend_totals(url))
    assert health_generate(url)  # one more forward: its verify covers the last decode
    delta = {key: after[key] - before[key] for key in after}
    assert semblend_server.log_path is not None
    text = semblend_server.log_path.read_text(errors="replace")
    assert "install_canary: " in text and "mode=<CanaryMode.RAISE" in text
    assert "kv_canary violation" not in text
    assert one_span["meta_info"]["completion_tokens"] == 16
    assert two_spans["meta_info"]["completion_tokens"] == 16
    assert delta["materialized"] == 2, delta
    assert delta["reused_spans"] >= 3, delta
    assert delta["recompute_checks"] >= 2, delta
    assert delta["canary_batches"] >= 1, delta
    assert delta["errors"] == 0, delta
