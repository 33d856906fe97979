"""The version matrix's served tests (``make test-matrix``, docs/sglang.md "Version matrix"), run
in the real SGLang server on CPU with whichever sglang the environment holds (0.5.21, 0.5.22,
0.5.23): on a version an adapter serves, one semantic hit confirmed by the server's own counters
and checked against a cold run of the same prompt; on a version none serves (0.5.21), the
refusal at start-up, by name, with SGLang left serving unpatched.

Marked ``matrix``; skipped unless ``SEMBLEND_TEST_MATRIX=1`` (``make test-matrix`` sets it), so
``make test`` does not spend CI time on it: tests/test_e2e_semantic.py covers the same path on
0.5.23 there. It uses the session's shared semblend server (tests/conftest.py) and an essay no
other test of that server uses.
"""

from __future__ import annotations

import os
from importlib.metadata import version
from typing import Any

import pytest

from semblend_sglang.bench.client import semblend_state
from semblend_sglang.patches.sglang import adapter_class_for, installed_sglang_version
from semblend_sglang.server import SglangServer, http_json
from tests.harness.server import copied_tokens, generate, outcome_count, semblend_metrics

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.matrix,
    pytest.mark.skipif(
        os.environ.get("SEMBLEND_TEST_MATRIX") != "1",
        reason="the version matrix's served test: make test-matrix (SEMBLEND_TEST_MATRIX=1)",
    ),
]

DONOR_HEAD = "Summarize the following essay in three sentences.\n\n"
TARGET_HEAD = "Read the essay below carefully and list the author's main arguments.\n\n"
DOC_TOKENS = 1000
NEW_TOKENS = 16
AGREE_TOKENS = 4
"""Greedy tokens the hit must share with the cold run of its prompt: the reused document KV
attended to another instruction, so decoding may part later (tests/test_e2e_semantic.py)."""


SERVED = adapter_class_for(installed_sglang_version()) is not None
"""Whether an adapter serves the installed sglang (decides which of the two tests applies)."""


def _check_server_version(url: str) -> str:
    """The installed sglang version, asserted to be the one the server at ``url`` runs."""
    installed = version("sglang")
    info = http_json(url + "/get_server_info", timeout=60)
    assert info["version"] == installed, (info["version"], installed)
    return installed


@pytest.mark.skipif(not SERVED, reason="no adapter serves this sglang: the refusal test applies")
def test_served_semantic_hit_matches_cold_run(
    semblend_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    url = semblend_server.url
    installed = _check_server_version(url)
    state = semblend_state(url)
    assert state is not None, "the plugin's /semblend/snapshot route is missing"
    assert not state.get("reuse_off"), (installed, state.get("reuse_off"))

    enc = smollm2_tokenizer.encode
    doc = enc(essay_texts[33], add_special_tokens=False)[:DOC_TOKENS]
    assert len(doc) == DOC_TOKENS
    generate(url, enc(DONOR_HEAD, add_special_tokens=False) + doc, 4)  # the donor
    before = semblend_metrics(url)
    target = enc(TARGET_HEAD, add_special_tokens=False) + doc
    hit = generate(url, target, NEW_TOKENS)
    after = semblend_metrics(url)
    assert outcome_count(after, "materialized") - outcome_count(before, "materialized") == 1, (
        installed,
        before,
        after,
    )
    assert copied_tokens(after) - copied_tokens(before) >= 0.9 * DOC_TOKENS, (
        installed,
        before,
        after,
    )
    assert hit["meta_info"]["completion_tokens"] == NEW_TOKENS

    cold = generate(url, target, NEW_TOKENS, cache_salt="matrix-cold")  # no donor, no prefix
    assert cold["meta_info"]["cached_tokens"] == 0
    assert outcome_count(semblend_metrics(url), "materialized") == outcome_count(
        after, "materialized"
    )
    got, want = hit["output_ids"], cold["output_ids"]
    agree = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))
    assert agree >= AGREE_TOKENS, (installed, got, want)


@pytest.mark.skipif(SERVED, reason="an adapter serves this sglang: the served-hit test applies")
def test_unserved_version_is_refused_by_name_and_serves_unpatched(
    semblend_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    url = semblend_server.url
    installed = _check_server_version(url)
    state = semblend_state(url)
    assert state is not None, "the plugin's /semblend/snapshot route is missing"
    reasons = state.get("reuse_off") or []
    assert any(f"sglang {installed} is not supported" in r for r in reasons), reasons
    assert state["ranks"] == [], state  # no scheduler was patched

    enc = smollm2_tokenizer.encode
    doc = enc(essay_texts[33], add_special_tokens=False)[:DOC_TOKENS]
    generate(url, enc(DONOR_HEAD, add_special_tokens=False) + doc, 4)
    target = enc(TARGET_HEAD, add_special_tokens=False) + doc
    answer = generate(url, target, NEW_TOKENS)
    cold = generate(url, target, NEW_TOKENS, cache_salt="matrix-cold")
    assert answer["meta_info"]["completion_tokens"] == NEW_TOKENS
    assert answer["output_ids"] == cold["output_ids"]  # nothing reused: the cold answer
    assert outcome_count(semblend_metrics(url), "materialized") == 0
