"""End to end on torch_native off the CPU runtime's query-only default: the real SGLang 0.5.23
CPU server with ``SEMBLEND_CPU_QUERY_ONLY_EXTEND=0`` runs SGLang's own SDPA extend for ordinary
batches (what a torch_native server does on another device) at ``--page-size 16``, and a batch
holding a sparse request runs the position-masked query-only extend (faster than SGLang's SDPA
over the split view: docs/perf-archive.md). A semantic hit (reordered passages; another instruction)
reuses and is counted on the position-mask path. A one-span hit (another instruction) answers as
the same prompt computed cold; a multi-span one (reordered passages, 15% recomputed: approximate
by design) answers as its dense reference (every position computed, the unselected ones on the
donor's K/V), the same selection without the query-only path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.bench.client import flush_cache
from semblend_sglang.server import SglangServer
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 2e-3
"""float32 rounding of the same attention computed by two paths (query-only vs full rows)."""


@pytest.fixture(scope="module")
def torch_native_server(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    from tests.harness.server import healthy_server

    log = tmp_path_factory.mktemp("torch-native-paged") / "server.log"
    env = {"SEMBLEND_ENABLED": "1", "SEMBLEND_CPU_QUERY_ONLY_EXTEND": "0"}
    with healthy_server(smollm2_model_dir, log, env, ["--page-size", "16"]) as srv:
        yield srv


@pytest.mark.parametrize("workload", ["rag", "cross_instruction"])
def test_a_hit_runs_query_only_and_answers_as_cold(
    torch_native_server: SglangServer,
    smollm2_tokenizer: Any,
    essay_texts: list[str],
    workload: str,
) -> None:
    from semblend_sglang.bench.builtin_workloads import build_workload

    url = torch_native_server.url
    group = build_workload(workload, smollm2_tokenizer, essay_texts, 1024, 1, 5).groups[0]
    donors = [list(d.prompt_ids) for d in group.donors]
    probe = list(group.probes[0].prompt_ids)
    for donor in donors:
        generate(url, donor, 1)
    before = semblend_totals(url)
    hit = generate(url, probe, 16, sampling={"ignore_eos": True}, return_logprob=True)
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1, after
    assert after["reused_tokens"] - before["reused_tokens"] >= 256, after
    assert after["errors"] == {}, after
    paths = {
        path: after["sparse_extend_batches"][path] - before["sparse_extend_batches"][path]
        for path in after["sparse_extend_batches"]
    }
    assert paths == {"split_view": 0, "position_mask": 1}, paths
    if workload == "rag":
        flush_cache(url)
        for donor in donors:
            generate(url, donor, 1)
        reference = generate(
            url,
            probe,
            8,
            sampling={"ignore_eos": True},
            custom_params={"semblend_dense_reference": True},
            return_logprob=True,
        )
        assert hit["output_ids"][:8] == reference["output_ids"], (hit, reference)
        gaps = [
            abs(float(a[0]) - float(b[0]))
            for a, b in zip(
                hit["meta_info"]["output_token_logprobs"][:8],
                reference["meta_info"]["output_token_logprobs"],
                strict=True,
            )
        ]
        assert max(gaps) <= LOGPROB_TOLERANCE, gaps
        return
    cold = generate(
        url, probe, 16, sampling={"ignore_eos": True}, cache_salt=f"torch-native-cold-{workload}"
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
