"""End to end at ``--page-size 16``: the real SGLang 0.5.23 CPU server with semblend reuses a
document under another instruction and over reordered passages, answers as the same prompt
computed cold, and stays healthy through its idle memory check (SGLang's strict idle check
raises on a page that is free and owned, or lost)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.server import SglangServer
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e

PAGE = 16


@pytest.fixture(scope="module")
def paged_server(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    from tests.harness.server import healthy_server

    log = tmp_path_factory.mktemp("paged-server") / "server.log"
    extra = ["--page-size", str(PAGE)]
    with healthy_server(smollm2_model_dir, log, {"SEMBLEND_ENABLED": "1"}, extra) as srv:
        yield srv


def _agreement(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))


@pytest.mark.parametrize("workload", ["cross_instruction", "rag"])
def test_page_size_16_reuses_and_answers_as_cold(
    paged_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str], workload: str
) -> None:
    from semblend_sglang.bench.builtin_workloads import build_workload

    group = build_workload(workload, smollm2_tokenizer, essay_texts, 1024, 1, 7).groups[0]
    for donor in group.donors:
        generate(paged_server.url, donor.prompt_ids, 1)
    probe = group.probes[0].prompt_ids
    before = semblend_totals(paged_server.url)
    hit = generate(paged_server.url, probe, 16, sampling={"ignore_eos": True})
    after = semblend_totals(paged_server.url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1, after
    assert after["reused_tokens"] - before["reused_tokens"] >= 256, after
    assert not after.get("unsupported_options"), after
    cold = generate(
        paged_server.url,
        probe,
        16,
        sampling={"ignore_eos": True},
        cache_salt=f"paged-cold-{workload}",
    )
    assert cold["meta_info"]["cached_tokens"] == 0
    assert _agreement(hit["output_ids"], cold["output_ids"]) >= 4, (hit, cold)


def test_paged_server_is_healthy_after_idling(paged_server: SglangServer) -> None:
    """SGLang checks its pools when idle (free + used == size) and raises on a leak: after the
    reuse above (held donors included), the server still answers."""
    time.sleep(3)
    out = generate(paged_server.url, [1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert out["meta_info"]["completion_tokens"] == 2
    totals = semblend_totals(paged_server.url)
    assert totals["errors"] == {}, totals
