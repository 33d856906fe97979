"""sglang 0.5.23's real Triton ``extend_attention_fwd`` under TRITON_INTERPRET=1 on CPU, against
the dense position-masked reference: with the position-mask metadata
(kernels.sparse_extend_triton), and inside the real TritonAttnBackend (`init_forward_metadata`,
`forward_extend`) with the hooks, which run each sparse batch as its split view or with the mask,
whichever costs less tile work; and the hooks' refusals."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from semblend_sglang.kernels.sparse_extend import ExtendRows
from semblend_sglang.kernels.sparse_extend_triton import (
    IS_CAUSAL,
    SKIP_PREFIX_CUSTOM_MASK,
    build_sparse_extend_metadata,
)
from semblend_sglang.patches.sglang.attention.hook_kit import SparseExtendUnsupported
from semblend_sglang.patches.sglang.attention.split_view import split_view_of
from semblend_sglang.patches.sglang.attention.triton_backend import split_is_cheaper
from tests.harness.attention_backend import ATOL, forward_batch, reference
from tests.sparse_extend_batches import Batch, random_batch
from tests.triton_mode import run_interpreted, triton_interpreted

pytest.importorskip("sglang")
pytest.importorskip("triton")

INTERPRETED = triton_interpreted()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_kernel_tests_under_the_interpreter's child process"
)
KERNEL_TESTS = 31  # tests the child must pass: 27 needs_interpreter cases + 4 without the mark
BLOCK = 16  # BLOCK_M = BLOCK_N in the kernel-level tests: queries span several causal tiles


def test_kernel_tests_under_the_interpreter():
    """Run this module's kernel tests in a child started with TRITON_INTERPRET=1."""
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    run_interpreted(__file__, KERNEL_TESTS, timeout=600)


@pytest.fixture(scope="module")
def extend_attention_fwd() -> Iterator[Callable[..., Any]]:
    """sglang's interpreted extend_attention_fwd with 16x16 tiles."""
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    import sglang.kernels.ops.attention.extend_attention as mod
    import triton

    shipped = mod._get_block_sizes_for_extend_attention

    def block_sizes(lq: int, lv: int) -> tuple[int, int, int, int, int, int]:
        return triton.next_power_of_2(lq), 0, triton.next_power_of_2(lv), BLOCK, BLOCK, 4

    mod._get_block_sizes_for_extend_attention = block_sizes
    yield mod.extend_attention_fwd
    mod._get_block_sizes_for_extend_attention = shipped


def _run(fwd: Callable[..., Any], batch: Batch, md: Any, **kw: Any) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    fwd(
        batch.q,
        batch.k.contiguous(),
        batch.v.contiguous(),
        out,
        batch.k_cache,
        batch.v_cache,
        md.qo_indptr,
        md.kv_indptr,
        md.kv_indices,
        md.custom_mask,
        kw.pop("is_causal", IS_CAUSAL),
        md.mask_indptr,
        md.max_extend_len,
        1.0,
        1.0,
        **kw,
    )
    return out


@needs_interpreter
@pytest.mark.parametrize("seed", range(3))
def test_kernel_with_sparse_metadata_matches_reference(
    extend_attention_fwd: Callable[..., Any], seed: int
):
    heads = [(2, 1), (2, 2), (4, 1)][seed]
    batch = random_batch(seed, n_requests=4, max_len=32, heads=heads)
    md = build_sparse_extend_metadata(batch.rows())
    out = _run(extend_attention_fwd, batch, md, skip_prefix_custom_mask=SKIP_PREFIX_CUSTOM_MASK)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)


@needs_interpreter
def test_is_causal_false_gives_the_same(extend_attention_fwd: Callable[..., Any]):
    """is_causal only bounds the extend loop at the diagonal tile; the mask is lower-triangular
    there, so both flags agree (module doc: why IS_CAUSAL=True misses no key)."""
    batch = random_batch(
        5, n_requests=2, min_len=34, max_len=40, heads=(1, 1), kinds=("cold", "sparse")
    )
    assert int(batch.extend_seq_lens.max()) > 2 * BLOCK  # three query tiles
    md = build_sparse_extend_metadata(batch.rows())
    a = _run(extend_attention_fwd, batch, md, skip_prefix_custom_mask=False, is_causal=True)
    b = _run(extend_attention_fwd, batch, md, skip_prefix_custom_mask=False, is_causal=False)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    torch.testing.assert_close(a, reference(batch), atol=ATOL, rtol=0)


@needs_interpreter
def test_shipped_default_skips_the_prefix_mask(extend_attention_fwd: Callable[..., Any]):
    """With sglang's default skip_prefix_custom_mask=True every prefix key is visible: wrong for
    a sparse request (a reused key after a query's position leaks in)."""
    batch = random_batch(6, n_requests=1, max_len=32, heads=(1, 1), kinds=("sparse",))
    md = build_sparse_extend_metadata(batch.rows())
    out = _run(extend_attention_fwd, batch, md)  # default skip_prefix_custom_mask=True
    assert (out - reference(batch)).abs().max() > 1e-3


def test_metadata_layout():
    """n = 8, row = slots 100..107, computed positions 0, 3, 5: prefix = positions 1, 2, 4 (6 and
    7 lie past the last query, never visible)."""
    req_to_token = torch.arange(100, 108, dtype=torch.int32)[None, :]
    md = build_sparse_extend_metadata(
        ExtendRows(
            req_to_token,
            torch.tensor([0]),
            torch.tensor([8]),
            torch.tensor([3]),
            torch.tensor([0, 3, 5]),
        )
    )
    assert md.kv_indices.tolist() == [101, 102, 104]
    assert md.kv_indptr.tolist() == [0, 3] and md.qo_indptr.tolist() == [0, 3]
    assert md.mask_indptr.tolist() == [0, 18] and md.max_extend_len == 3
    # prefix keys at positions 1, 2, 4 | extend keys 0, 1, 2 (positions 0, 3, 5)
    assert md.custom_mask.view(3, 6).tolist() == [
        [0, 0, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]


def test_metadata_of_an_ordinary_request_is_sglangs():
    """An exact hit: prefix = row[0:m], every prefix key visible, causal extend part."""
    req_to_token = torch.arange(50, 60, dtype=torch.int32)[None, :]
    one = (req_to_token, torch.tensor([0]), torch.tensor([10]), torch.tensor([3]))
    md = build_sparse_extend_metadata(ExtendRows(*one, torch.arange(7, 10)))
    assert md.kv_indices.tolist() == list(range(50, 57))
    mask = md.custom_mask.view(3, 10)
    assert bool(mask[:, :7].all()) and mask[:, 7:].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_metadata_rejects_bad_batches():
    r2t = torch.arange(8, dtype=torch.int32)[None, :]
    one = (r2t, torch.tensor([0]), torch.tensor([8]), torch.tensor([2]))
    with pytest.raises(ValueError, match="ascending"):
        build_sparse_extend_metadata(ExtendRows(*one, torch.tensor([5, 3])))
    with pytest.raises(ValueError, match="ascending"):
        build_sparse_extend_metadata(ExtendRows(*one, torch.tensor([3, 8])))
    with pytest.raises(ValueError, match="packed"):
        build_sparse_extend_metadata(ExtendRows(*one, torch.tensor([3, 5]), torch.tensor([1])))


@pytest.fixture
def hooks() -> Any:
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from semblend_sglang.patches.sglang.attention import backends

    backends.install_attention_hooks(triton=True)
    yield backends
    backends.remove_attention_hooks()


@needs_interpreter
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["sparse_runs", "sparse"])
def test_real_triton_backend_matches_reference_on_either_path(hooks: Any, seed: int, kind: str):
    """Mixed batches (cold, exact hit, sparse non-final chunk, and sparse requests of a few long
    runs or of many short ones): the backend's own metadata and kernel over the split view (few
    runs) or with the position mask (many runs) equal the dense reference."""
    from tests.harness import triton_backend

    heads = [(2, 1), (2, 2), (4, 1), (6, 2)][seed]
    kinds = (kind, "cold", "exact", "sparse_chunk", kind)
    batch = random_batch(seed, n_requests=5, min_len=12, max_len=64, heads=heads, kinds=kinds)
    triton = triton_backend.backend(batch)
    out = triton_backend.forward(batch, triton=triton)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)
    split = split_is_cheaper(forward_batch(batch), split_view_of(forward_batch(batch)).sequences)
    assert (triton.forward_metadata.custom_mask is None) is split


@needs_interpreter
@pytest.mark.parametrize("pinned", ["split_view", "position_mask"])
def test_a_pinned_sparse_path_runs_whatever_its_tile_work(hooks: Any, pinned: str):
    """The ``sparse_path`` setting pins triton's path (the any-weights check compares them): the
    same batch runs split or masked as pinned, each equal to the dense reference; a value that
    is not a path is refused."""
    from tests.harness import triton_backend

    batch = random_batch(
        5, n_requests=3, min_len=40, max_len=96, heads=(4, 2), kinds=("sparse",) * 3
    )
    hooks.set_sparse_path(pinned)
    triton = triton_backend.backend(batch)
    out = triton_backend.forward(batch, triton=triton)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)
    assert (triton.forward_metadata.custom_mask is None) is (pinned == "split_view")
    with pytest.raises(ValueError, match="sparse_path"):
        hooks.set_sparse_path("dense")


def test_few_long_runs_split_and_many_short_runs_mask():
    """The tile-work choice: three long runs per request cost less split; a position every other
    token costs less masked (each run would read its whole prefix again)."""
    from semblend_sglang.patches.sglang.attention.split_view import split_sequences

    few = forward_batch(
        random_batch(1, n_requests=3, min_len=300, max_len=400, kinds=("sparse_runs",) * 3)
    )
    assert split_is_cheaper(few, split_sequences(few))
    many = forward_batch(
        random_batch(1, n_requests=3, min_len=300, max_len=400, kinds=("sparse",) * 3)
    )
    assert not split_is_cheaper(many, split_sequences(many))


@needs_interpreter
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kind", ["sparse_runs", "sparse"])
def test_real_triton_backend_at_a_page_size_above_1(hooks: Any, page_size: int, kind: str):
    """At page size 16 and 64 (rows in whole pages, the kernel addressing the paged pool by
    page and offset), either path equals the dense reference."""
    from tests.harness import triton_backend

    kinds = (kind, "cold", "exact", "sparse_chunk")
    batch = random_batch(
        3, n_requests=4, min_len=12, max_len=90, heads=(4, 2), kinds=kinds, page_size=page_size
    )
    triton = triton_backend.backend(batch, page_size=page_size)
    assert hooks.sparse_extend_supported(triton)
    out = triton_backend.forward(batch, triton=triton)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)


@needs_interpreter
def test_more_runs_than_the_request_pool_has_rows(hooks: Any):
    """SGLang sizes the per-sequence buffers by the request pool; a split view may hold more
    sequences. The hook lends larger buffers for the call and puts the originals back."""
    from tests.harness import triton_backend

    batch = random_batch(
        14, n_requests=3, min_len=260, max_len=320, heads=(2, 1), kinds=("sparse_runs",) * 3
    )
    fb = forward_batch(batch)
    seqs = split_view_of(fb).sequences
    assert seqs is not None and len(seqs.seq) > 4  # more runs than max_bs below
    assert split_is_cheaper(fb, seqs)
    triton = triton_backend.backend(batch, max_bs=4)
    buffers = (triton.kv_indptr, triton.qo_indptr, triton.mask_indptr)
    out = triton_backend.forward(batch, triton=triton, fb=fb)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)
    assert triton.forward_metadata.custom_mask is None  # the split view ran
    assert (triton.kv_indptr, triton.qo_indptr, triton.mask_indptr) == buffers


@needs_interpreter
def test_ordinary_batches_keep_sglangs_metadata(hooks: Any):
    """No sparse request: the hooked backend builds exactly SGLang's metadata and output."""
    from tests.harness import triton_backend

    ordinary = random_batch(7, n_requests=3, max_len=32, heads=(2, 1), kinds=("exact", "cold"))
    hooked = triton_backend.backend(ordinary)
    out = triton_backend.forward(ordinary, triton=hooked)
    hooks.remove_attention_hooks()
    shipped = triton_backend.backend(ordinary)
    expected = triton_backend.forward(ordinary, triton=shipped)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for name in ("qo_indptr", "kv_indptr", "kv_indices"):
        a = getattr(hooked.forward_metadata, name)
        assert torch.equal(a, getattr(shipped.forward_metadata, name)), name
    torch.testing.assert_close(out, reference(ordinary), atol=ATOL, rtol=0)


@needs_interpreter
def test_without_the_hooks_a_sparse_batch_is_wrong(hooks: Any):
    """SGLang alone reads a sparse request's prefix as [0, m) and its extend as contiguous: the
    output differs from the reference, so the test above can fail."""
    from tests.harness import triton_backend

    hooks.remove_attention_hooks()
    sparse = random_batch(6, n_requests=1, max_len=32, heads=(1, 1), kinds=("sparse",))
    out = triton_backend.forward(sparse)
    assert (out - reference(sparse)).abs().max() > 1e-3


@needs_interpreter
@pytest.mark.parametrize(
    "what", ["dcp", "deterministic", "encoder_only", "sliding_window", "no_positions"]
)
def test_hooks_refuse_what_the_split_view_cannot_carry(hooks: Any, what: str):
    from sglang.srt.layers.radix_attention import AttentionType

    from tests.harness import triton_backend

    sparse = random_batch(9, n_requests=2, max_len=30, kinds=("sparse", "cold"))
    triton = triton_backend.backend(sparse)
    layer_kw: dict[str, Any] = {}
    fb = forward_batch(sparse)
    if what == "dcp":
        triton.dcp_size = 2
    elif what == "deterministic":
        triton.enable_deterministic = True
    elif what == "encoder_only":
        layer_kw["attn_type"] = AttentionType.ENCODER_ONLY
    elif what == "sliding_window":
        layer_kw["sliding_window_size"] = 8
    elif what == "no_positions":
        fb = forward_batch(sparse, positions=None)
    with pytest.raises(SparseExtendUnsupported):
        triton_backend.forward(sparse, triton=triton, fb=fb, **layer_kw)
