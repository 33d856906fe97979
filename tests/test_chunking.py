"""Chunking and hashing primitives: the vectorized forms equal their plain definitions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semblend_sglang.chunking import (
    POLY_BASE,
    ChunkParams,
    _boundaries,
    chunk_tokens,
    kgram_hashes,
    poly_prefix,
    strided_window_hashes,
    token_hashes,
    token_prefix,
    window_hashes,
)

MASK = (1 << 64) - 1


def poly(values: list[int]) -> int:
    """The polynomial hash by its definition: sum(v_t * POLY_BASE**t) modulo 2**64."""
    return sum(v * pow(POLY_BASE, t, 1 << 64) for t, v in enumerate(values)) & MASK


def reference_boundaries(candidates: list[int], n: int, params: ChunkParams) -> list[int]:
    """The documented rule, one candidate at a time: keep a candidate when the previous candidate
    (or 0) lies at least min_size before it; cut gaps longer than max_size every max_size tokens
    from the gap's start."""
    kept = [
        c
        for i, c in enumerate(candidates)
        if c - (candidates[i - 1] if i else 0) >= params.min_size
    ]
    bounds = [0]
    for b in [*kept, n]:
        while b - bounds[-1] > params.max_size:
            bounds.append(bounds[-1] + params.max_size)
        bounds.append(b)
    return bounds


tokens_st = st.lists(st.integers(0, 70000), min_size=0, max_size=300)


@settings(max_examples=200, deadline=None)
@given(tokens_st)
def test_token_prefix_is_the_polynomial_hash_of_the_token_hashes(tokens: list[int]) -> None:
    arr = np.asarray(tokens, dtype=np.int64)
    prefix = token_prefix(arr)
    assert np.array_equal(prefix, poly_prefix(token_hashes(arr)))
    hashes = [int(h) for h in token_hashes(arr)]
    for i in (0, len(tokens) // 2, len(tokens)):
        assert int(prefix[i]) == poly(hashes[:i])


@settings(max_examples=200, deadline=None)
@given(tokens_st, st.integers(1, 40), st.integers(1, 40))
def test_window_hashes_agree_with_the_definition(tokens: list[int], k: int, stride: int) -> None:
    arr = np.asarray(tokens, dtype=np.int64)
    hashes = [int(h) for h in token_hashes(arr)]
    prefix = token_prefix(arr)
    all_k = kgram_hashes(None, k, prefix)
    assert np.array_equal(all_k, kgram_hashes(token_hashes(arr), k))
    assert [int(x) for x in all_k] == [poly(hashes[i : i + k]) for i in range(len(tokens) - k + 1)]
    strided = strided_window_hashes(prefix, k, stride)
    assert np.array_equal(strided, all_k[::stride])
    starts = np.arange(0, max(len(tokens) - k + 1, 0), stride, dtype=np.int64)
    assert np.array_equal(window_hashes(prefix, starts, k), strided)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 2000).flatmap(
        lambda n: st.tuples(
            st.just(n), st.sets(st.integers(1, n - 1), max_size=200) if n > 1 else st.just(set())
        )
    ),
    st.sampled_from([(8, 16, 64), (8, 8, 8), (4, 16, 16), (1, 1, 3), (8, 32, 256)]),
)
def test_vectorized_boundaries_follow_the_documented_rule(
    case: tuple[int, set[int]], sizes: tuple[int, int, int]
) -> None:
    n, cands = case
    window, min_size, max_size = sizes
    params = ChunkParams(window=window, avg=64, min_size=min_size, max_size=max_size)
    candidates = sorted(cands)
    bounds, lengths = _boundaries(np.asarray(candidates, dtype=np.int64), n, params)
    assert bounds.tolist() == reference_boundaries(candidates, n, params)
    assert lengths.tolist() == np.diff(bounds).tolist()
    assert lengths.min() >= 1 and lengths.max() <= max_size


@pytest.fixture(scope="module")
def essay_ids(smollm2_tokenizer: Any, essay_texts: list[str]) -> np.ndarray:
    ids = [smollm2_tokenizer(t, add_special_tokens=False)["input_ids"] for t in essay_texts[:8]]
    return np.asarray([tok for part in ids for tok in part], dtype=np.int64)


def test_chunks_of_real_text_have_sane_sizes_and_content_hashes(essay_ids: np.ndarray) -> None:
    params = ChunkParams()
    chunks = chunk_tokens(essay_ids, params)
    lengths = chunks.lengths
    assert int(lengths.sum()) == essay_ids.size
    assert lengths.max() <= params.max_size
    assert 48 <= float(lengths.mean()) <= 128  # avg 64, stretched a little by min_size
    assert float(np.mean(lengths < params.min_size)) < 0.02
    # a chunk's hash is a function of its tokens only: recompute each one on its own
    for s, e, h in list(zip(chunks.starts, chunks.ends, chunks.hashes, strict=True))[:50]:
        alone = token_prefix(essay_ids[s:e])
        assert int(h) == int(alone[-1]) ^ int(e - s)


def test_token_hashes_are_distinct_for_distinct_ids() -> None:
    ids = np.arange(0, 200_000, dtype=np.int64)
    assert np.unique(token_hashes(ids)).size == ids.size
