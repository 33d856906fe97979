"""End to end through SGLang's own attention over the split view: the real SGLang 0.5.23 CPU
server with ``SEMBLEND_CPU_QUERY_ONLY_EXTEND=0`` runs torch_native's own SDPA extend (what a
torch_native server does off the CPU runtime) at ``--page-size 16``, a batch with a sparse
request handed over as one extend sequence per computed run when that costs less tile work than
masking by position (the ``heads`` repair keeps runs long). A semantic hit of two long computed
runs reuses, takes the split view (its snapshot's ``sparse_extend_batches``), and answers as the
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
    env = {
        "SEMBLEND_ENABLED": "1",
        "SEMBLEND_CPU_QUERY_ONLY_EXTEND": "0",
        "SEMBLEND_RECOMPUTE_STRATEGY": "heads",
    }
    with healthy_server(smollm2_model_dir, log, env, ["--page-size", "16"]) as srv:
        yield srv


EDIT = 192
"""Tokens replaced at the head and appended at the tail of the edited-ends probe."""


@pytest.mark.parametrize("workload", ["edited_ends"])
def test_sglangs_own_extend_over_the_split_view_answers_as_cold(
    split_view_server: SglangServer,
    smollm2_tokenizer: Any,
    essay_texts: list[str],
    workload: str,
) -> None:
    """``edited_ends``: a donor whose first and last EDIT tokens are other text computes two
    long runs (with the heads repair's first tokens of the reused span), which the split view
    carries. Batches of many short runs take the position mask: tests/test_attention_hooks.py
    and the other e2e tests (the CPU runtime's query-only extend)."""
    from semblend_sglang.bench.builtin_workloads import build_workload

    url = split_view_server.url
    base = "cross_instruction" if workload == "edited_ends" else workload
    group = build_workload(base, smollm2_tokenizer, essay_texts, 1024, 1, 5).groups[0]
    donors = [list(d.prompt_ids) for d in group.donors]
    probe = list(group.probes[0].prompt_ids)
    if workload == "edited_ends":
        filler = smollm2_tokenizer.encode(essay_texts[-1], add_special_tokens=False)
        donors = donors[:1]
        probe = filler[:EDIT] + donors[0][EDIT:-EDIT] + filler[-EDIT:]
    for donor in donors:
        generate(url, donor, 1)
    before = semblend_totals(url)
    hit = generate(url, probe, 16, sampling={"ignore_eos": True})
    after = semblend_totals(url)
    paths = {
        path: after["sparse_extend_batches"][path] - before["sparse_extend_batches"][path]
        for path in after["sparse_extend_batches"]
    }
    assert sum(paths.values()) >= 1, paths
    if workload == "edited_ends":
        assert paths["split_view"] >= 1, paths
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
