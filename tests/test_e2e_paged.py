"""End to end at ``--page-size 16`` on torch_native off the CPU runtime's query-only default: one
real SGLang 0.5.23 CPU server with semblend, ``SEMBLEND_CPU_QUERY_ONLY_EXTEND=0``, so ordinary
batches run SGLang's own SDPA extend (what a torch_native server does on another device) and a
batch holding a sparse request runs the position-masked query-only extend (faster than SGLang's
SDPA over the split view: docs/perf-archive.md).

On it, a document under another instruction and reordered passages are reused, counted on the
position-mask path, and answer as the same prompt computed cold (a one-span hit) or as the
plan's dense reference (a multi-span one: every position computed, the unselected ones on the
donor's K/V, 15% recomputed, approximate by design); the server stays healthy through its idle
memory check (SGLang's strict idle check raises on a page that is free and owned, or lost).
The page-size tests and the torch-native tests share this one server: the page bookkeeping
they check does not depend on which extend attends an ordinary batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.bench.client import flush_cache
from semblend_sglang.server import SglangServer
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e

PAGE = 16
LOGPROB_TOLERANCE = 2e-3
"""float32 rounding of the same attention computed by two paths (query-only vs full rows)."""


@pytest.fixture(scope="module")
def paged_server(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    """The module's one server: semblend on, page size 16, SGLang's own extend for ordinary
    batches."""
    from tests.harness.server import healthy_server

    log = tmp_path_factory.mktemp("paged-server") / "server.log"
    env = {"SEMBLEND_ENABLED": "1", "SEMBLEND_CPU_QUERY_ONLY_EXTEND": "0"}
    with healthy_server(smollm2_model_dir, log, env, ["--page-size", str(PAGE)]) as srv:
        yield srv


def _agreement(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))


def _semantic_hit(
    url: str, donors: list[list[int]], probe: list[int], **extra: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """From an empty cache (no donor of another test of this server), the donors, then the
    probe's 16 greedy tokens (``extra``: more :func:`generate` arguments); asserts the probe
    materialized reuse of at least 256 tokens. Returns the hit and the totals before and after."""
    flush_cache(url)
    for donor in donors:
        generate(url, donor, 1)
    before = semblend_totals(url)
    hit = generate(url, probe, 16, sampling={"ignore_eos": True}, **extra)
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1, after
    assert after["reused_tokens"] - before["reused_tokens"] >= 256, after
    return hit, before, after


@pytest.mark.parametrize("workload", ["cross_instruction", "rag"])
def test_page_size_16_reuses_and_answers_as_cold(
    paged_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str], workload: str
) -> None:
    from semblend_sglang.bench.builtin_workloads import build_workload

    group = build_workload(workload, smollm2_tokenizer, essay_texts, 1024, 1, 7).groups[0]
    probe = list(group.probes[0].prompt_ids)
    donors = [list(d.prompt_ids) for d in group.donors]
    hit, _, after = _semantic_hit(paged_server.url, donors, probe)
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


@pytest.mark.parametrize("workload", ["rag", "cross_instruction"])
def test_a_hit_runs_query_only_and_answers_as_cold(
    paged_server: SglangServer,
    smollm2_tokenizer: Any,
    essay_texts: list[str],
    workload: str,
) -> None:
    from semblend_sglang.bench.builtin_workloads import build_workload

    url = paged_server.url
    group = build_workload(workload, smollm2_tokenizer, essay_texts, 1024, 1, 5).groups[0]
    donors = [list(d.prompt_ids) for d in group.donors]
    probe = list(group.probes[0].prompt_ids)
    hit, before, after = _semantic_hit(url, donors, probe, return_logprob=True)
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
    assert _agreement(hit["output_ids"], cold["output_ids"]) >= 4, (hit, cold)


def test_paged_server_is_healthy_after_idling(paged_server: SglangServer) -> None:
    """SGLang checks its pools when idle (free + used == size) and raises on a leak: after the
    reuse above (held donors included), the server still answers."""
    time.sleep(3)
    out = generate(paged_server.url, [1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert out["meta_info"]["completion_tokens"] == 2
    totals = semblend_totals(paged_server.url)
    assert totals["errors"] == {}, totals
