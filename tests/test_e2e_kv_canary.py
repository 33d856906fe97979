"""End to end: SGLang's own KV canary (``--kv-canary raise``) in the real CPU server with
semblend on (its CPU stand-ins: semblend_sglang/cpu_runtime/canary_shim.py). Under the default
settings a one-span hit is a sparse extend checked at the check layer, and a plan of two spans
computes every copied position up to the check layer (dense) and then shrinks; every later
forward verifies each request's slots, and a violation raises in the scheduler (the server
dies). Without the recorder (patches/sglang/kv_canary_record.py) this server dies at the first
hit: tried by hand, docs/sglang.md "SGLang's KV canary".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.bench.client import health_generate
from tests.harness.server import generate, healthy_server, semblend_totals

pytestmark = pytest.mark.e2e


def test_semantic_hits_pass_sglang_s_kv_canary(
    smollm2_model_dir: Path, smollm2_tokenizer: Any, essay_texts: list[str], tmp_path: Path
) -> None:
    def enc(text: str) -> list[int]:
        return list(smollm2_tokenizer.encode(text, add_special_tokens=False))

    doc = enc(essay_texts[3])[:600]
    asked = enc("List the main arguments of the essay below.\n\n")
    log = tmp_path / "server.log"
    env = {"SEMBLEND_ENABLED": "1"}
    with healthy_server(smollm2_model_dir, log, env, ["--kv-canary", "raise"]) as srv:
        generate(srv.url, enc("Summarize the following essay.\n\n") + doc, 8)
        one_span = generate(srv.url, asked + doc, 16)
        two_spans = generate(srv.url, asked + doc[:300] + enc(" (sic)") + doc[300:], 16)
        totals = semblend_totals(srv.url)
        assert health_generate(srv.url)  # one more forward: its verify covers the last decode
    text = log.read_text(errors="replace")
    assert "install_canary: " in text and "mode=<CanaryMode.RAISE" in text
    assert "kv_canary violation" not in text
    assert one_span["meta_info"]["completion_tokens"] == 16
    assert two_spans["meta_info"]["completion_tokens"] == 16
    assert totals["outcomes"].get("materialized") == 2, totals["outcomes"]
    assert totals["reused_spans"] >= 3, totals["reused_spans"]
    assert totals["recompute_checks"] >= 2
    assert totals["kv_canary_recorded"]["batches"] >= 1
    assert totals["errors"] == {}
