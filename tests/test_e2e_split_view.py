"""End to end through SGLang's own attention over the split view: the real SGLang 0.5.23 CPU
server with ``SEMBLEND_CPU_QUERY_ONLY_EXTEND=0`` runs torch_native's own SDPA extend (what a
torch_native server does off the CPU runtime), a batch with a sparse request handed over as one
extend sequence per computed run, at ``--page-size 16``. A semantic hit reuses and answers as the
same prompt computed cold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.server import SglangServer
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def split_view_server(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    from tests.harness.server import healthy_server

    log = tmp_path_factory.mktemp("split-view-server") / "server.log"
    env = {"SEMBLEND_ENABLED": "1", "SEMBLEND_CPU_QUERY_ONLY_EXTEND": "0"}
    with healthy_server(smollm2_model_dir, log, env, ["--page-size", "16"]) as srv:
        yield srv


@pytest.mark.parametrize("workload", ["rag", "cross_instruction"])
def test_sglangs_own_extend_over_the_split_view_answers_as_cold(
    split_view_server: SglangServer,
    smollm2_tokenizer: Any,
    essay_texts: list[str],
    workload: str,
) -> None:
    from semblend_sglang.bench.builtin_workloads import build_workload

    url = split_view_server.url
    group = build_workload(workload, smollm2_tokenizer, essay_texts, 1024, 1, 5).groups[0]
    for donor in group.donors:
        generate(url, donor.prompt_ids, 1)
    probe = group.probes[0].prompt_ids
    before = semblend_totals(url)
    hit = generate(url, probe, 16, sampling={"ignore_eos": True})
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1, after
    assert after["reused_tokens"] - before["reused_tokens"] >= 256, after
    assert after["errors"] == {}, after
    cold = generate(
        url, probe, 16, sampling={"ignore_eos": True}, cache_salt=f"split-cold-{workload}"
    )
    assert cold["meta_info"]["cached_tokens"] == 0
    agree = next(
        (
            i
            for i, (a, b) in enumerate(zip(hit["output_ids"], cold["output_ids"], strict=True))
            if a != b
        ),
        len(cold["output_ids"]),
    )
    assert agree >= 4, (hit, cold)
