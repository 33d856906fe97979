"""kernels.sparse_extend: the query-only extend against the dense position-masked reference."""

from __future__ import annotations

import pytest
import torch

from semblend_sglang.kernels import sparse_extend
from semblend_sglang.kernels.sparse_extend import (
    extend_attention_query_only,
    extend_attention_reference,
)
from tests.sparse_extend_batches import random_batch

ATOL = 2e-5  # float32 SDPA against a float64 oracle, |v| ~ 1


def _query_only(batch, extend_start_loc=None, **kw):  # type: ignore[no-untyped-def]
    out = torch.full_like(batch.q, float("nan"))
    hq, hkv = batch.q.shape[1], batch.k_cache.shape[1]
    return extend_attention_query_only(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        out,
        batch.rows(extend_start_loc=extend_start_loc),
        enable_gqa=hq != hkv,
        **kw,
    )


HEADS = [(4, 4), (6, 2), (8, 1)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dense_fraction", [0.0, 0.5, 2.0])
def test_query_only_matches_reference(seed: int, dense_fraction: float):
    """Mixes of cold / exact / sparse requests, MHA and GQA (by seed), each per-request form
    (0.0: all scattered causal; 2.0: all masked query-only; 0.5: the default split)."""
    batch = random_batch(seed, n_requests=5, heads=HEADS[seed % 3])
    ref = extend_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.rows())
    out = _query_only(batch, dense_fraction=dense_fraction)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_scaling_and_non_causal(seed: int):
    batch = random_batch(seed, heads=(6, 3))
    for causal in (True, False):
        ref = extend_attention_reference(
            batch.q, batch.k_cache, batch.v_cache, batch.rows(), scaling=0.3, causal=causal
        )
        out = _query_only(batch, scaling=0.3, causal=causal)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_reference_masks_by_position_not_index():
    """The oracle is not index-causal: placing a sparse request's queries at [m, m + c) (what
    SGLang's extend does with extend_prefix_lens) gives other outputs."""
    batch = random_batch(0, n_requests=1, kinds=("sparse",), max_len=40)
    m, c = int(batch.extend_prefix_lens[0]), int(batch.extend_seq_lens[0])
    assert m + c != int(batch.seq_lens[0])
    ref = extend_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.rows())
    index_causal = batch.rows(positions=torch.arange(m, m + c))
    wrong = extend_attention_reference(batch.q, batch.k_cache, batch.v_cache, index_causal)
    assert (ref - wrong).abs().max() > 1e-3


def test_cold_request_runs_is_causal(monkeypatch: pytest.MonkeyPatch):
    """A cold request runs SDPA with is_causal=True and no mask (docs/architecture.md); an exact hit
    with few new tokens runs only its queries with a boolean mask."""
    calls: list[tuple[int, bool, bool]] = []
    real = sparse_extend.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):  # type: ignore[no-untyped-def]
        calls.append((q.shape[-2], attn_mask is not None, is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(sparse_extend, "scaled_dot_product_attention", spy)
    cold = random_batch(1, n_requests=1, kinds=("cold",))
    _query_only(cold)
    n = int(cold.seq_lens[0])
    assert calls == [(n, False, True)]
    calls.clear()
    exact = random_batch(2, n_requests=1, kinds=("exact",), max_len=48)
    n, c = int(exact.seq_lens[0]), int(exact.extend_seq_lens[0])
    _query_only(exact, dense_fraction=2.0)
    assert calls == [(c, True, False)]


def test_reference_rejects_bad_positions():
    batch = random_batch(3, n_requests=1, kinds=("sparse",))
    bad = batch.positions.clone()
    bad[-1] = int(batch.seq_lens[0])
    with pytest.raises(ValueError, match="ascending"):
        extend_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.rows(positions=bad))
    short = batch.rows(positions=batch.positions[:-1])
    with pytest.raises(ValueError, match="positions"):
        extend_attention_reference(batch.q, batch.k_cache, batch.v_cache, short)


def test_extend_start_loc_is_honoured():
    """Queries may sit at explicit offsets (SGLang's extend_start_loc)."""
    batch = random_batch(4, n_requests=3, heads=(4, 2))
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), batch.extend_seq_lens.cumsum(0)[:-1]])
    ref = extend_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.rows())
    out = _query_only(batch, extend_start_loc=starts)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
