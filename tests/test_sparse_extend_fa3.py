"""sglang 0.5.23's real ``FlashAttentionBackend`` (fa3, SGLang's default on Hopper) carrying a
sparse extend through the split view, on CPU: its own ``init_forward_metadata`` and
``forward_extend`` run unmodified; only the CUDA kernel ``flash_attn_with_kvcache`` is a torch
stand-in of its documented paged-prefill contract (tests/harness/fa3_backend.py), itself checked
against the dense reference. Every test that runs the stand-in says ``standin`` in its name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from semblend_sglang.patches.sglang.attention.hook_kit import SparseExtendUnsupported
from tests.harness import fa3_backend
from tests.harness.attention_backend import ATOL, forward_batch, reference
from tests.sparse_extend_batches import KINDS, random_batch

pytest.importorskip("sglang")

PAGE_SIZES = (1, 16, 64)
HEADS = ((6, 2), (4, 4), (8, 1))


@pytest.fixture
def fa3_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """sglang's flashattention_backend with the kernel replaced by the torch stand-in."""
    module = fa3_backend.module()
    monkeypatch.setattr(
        module, "flash_attn_with_kvcache", fa3_backend.flash_attn_with_kvcache_standin
    )
    return module


@pytest.fixture
def hooks(fa3_module: Any) -> Iterator[Any]:
    """The attention hooks with fa3's installed (removed after)."""
    from semblend_sglang.patches.sglang.attention import backends

    backends.install_attention_hooks(triton=False, gpu_backends=("fa3",))
    try:
        assert backends.hooks_installed("fa3")
        yield backends
    finally:
        backends.remove_attention_hooks()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_kernel_standin_matches_reference_on_ordinary_batches(
    fa3_module: Any, page_size: int, heads: tuple[int, int]
):
    """The stand-in inside SGLang's unhooked backend equals the dense reference where SGLang's
    own metadata is right: cold and exact-hit requests only."""
    for seed in range(3):
        batch = random_batch(seed, kinds=("cold", "exact"), heads=heads, page_size=page_size)
        fa3 = fa3_backend.backend(batch, page_size)
        out = fa3_backend.forward(batch, fa3, forward_batch(batch))
        torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(4))
def test_real_fa3_backend_with_kernel_standin_matches_reference(
    hooks: Any, page_size: int, seed: int
):
    """Random batches mixing sparse (many runs), sparse chunks, few long runs, exact hits and
    cold requests: the split view through fa3's own metadata equals the position-masked
    reference, at page sizes 1, 16 and 64 and with GQA."""
    batch = random_batch(
        seed,
        n_requests=6,
        max_len=80,
        kinds=(*KINDS, "sparse_runs"),
        heads=HEADS[seed % len(HEADS)],
        page_size=page_size,
    )
    out = fa3_backend.forward(batch, fa3_backend.backend(batch, page_size), forward_batch(batch))
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)


def test_without_the_hooks_a_sparse_batch_is_wrong_kernel_standin(fa3_module: Any):
    """What the hooks fix: SGLang's fa3 reads a sparse request as prefix + contiguous extend."""
    batch = random_batch(5, n_requests=3, max_len=64, kinds=("sparse", "sparse_runs", "cold"))
    out = fa3_backend.forward(batch, fa3_backend.backend(batch), forward_batch(batch))
    assert (out - reference(batch)).abs().max() > 0.1


def test_split_metadata_and_the_real_batch_kernel_standin(hooks: Any):
    """fa3's metadata holds one sequence per computed run (cache length = run end, query count
    = run length, the request's own row); the real batch keeps its own boundaries."""
    from semblend_sglang.patches.sglang.attention.split_view import computed_runs

    batch = random_batch(7, n_requests=3, max_len=60, kinds=("sparse", "cold", "exact"))
    fb = forward_batch(batch)
    before = {
        name: getattr(fb, name).clone()
        for name in ("seq_lens", "extend_seq_lens", "extend_prefix_lens", "req_pool_indices")
    }
    fa3 = fa3_backend.backend(batch)
    fa3_backend.forward(batch, fa3, fb)
    runs, starts = [], 0
    for c in batch.extend_seq_lens.tolist():
        runs.append(computed_runs(batch.positions[starts : starts + c]))
        starts += c
    ends = [e for request in runs for _, e in request]
    lengths = [e - s for request in runs for s, e in request]
    meta = fa3.forward_metadata
    assert meta.cache_seqlens_int32.tolist() == ends
    assert torch.diff(meta.cu_seqlens_q).tolist() == lengths
    rows = [
        batch.req_to_token[int(row), : meta.page_table.shape[1]]
        for row, request in zip(batch.req_pool_indices.tolist(), runs, strict=True)
        for _ in request
    ]
    assert torch.equal(meta.page_table, torch.stack(rows))
    assert fb.batch_size == 3
    for name, value in before.items():
        assert torch.equal(getattr(fb, name), value), name


def test_refusals_name_fa3(hooks: Any):
    """A sparse batch on a sliding-window or cross-attention layer, or on a configuration
    fa3_supported refuses, raises SparseExtendUnsupported; an ordinary batch keeps SGLang's path
    in each case (the CUDA-graph and common refusals are tests/test_backend_contract.py's)."""
    from sglang.srt.layers.radix_attention import AttentionType

    backends = hooks
    batch = random_batch(3, n_requests=2, kinds=("sparse", "cold"))
    fa3 = fa3_backend.backend(batch)
    for kw in ({"sliding_window_size": 8}, {"attn_type": AttentionType.ENCODER_ONLY}):
        with pytest.raises(SparseExtendUnsupported, match="fa3"):
            fa3_backend.forward(batch, fa3, forward_batch(batch), **kw)
    for name, value in (("fa_impl_ver", 4), ("fa_skip_kv_cache", True)):
        other = fa3_backend.backend(batch)
        setattr(other, name, value)
        assert not backends.sparse_extend_supported(other)
        with pytest.raises(SparseExtendUnsupported, match="fa3: this backend"):
            other.init_forward_metadata(forward_batch(batch))
    ordinary = random_batch(3, n_requests=2, kinds=("cold", "exact"))
    out = fa3_backend.forward(
        ordinary, fa3_backend.backend(ordinary), forward_batch(ordinary), sliding_window_size=-1
    )
    torch.testing.assert_close(out, reference(ordinary), atol=ATOL, rtol=0)


def test_supported_at_every_page_size(fa3_module: Any):
    """fa3 is served at any page size once its hooks are installed, and only then."""
    from semblend_sglang.patches.sglang.attention import backends

    batch = random_batch(1, n_requests=1, kinds=("cold",))
    fa3 = fa3_backend.backend(batch, 16)
    assert not backends.sparse_extend_supported(fa3)
    backends.install_attention_hooks(triton=False, gpu_backends=("fa3",))
    try:
        assert backends.sparse_extend_supported(fa3)
        assert backends.backend_reuse_reason("fa3") is None
    finally:
        backends.remove_attention_hooks()
    assert not backends.hooks_installed("fa3")
