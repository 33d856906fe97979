"""sglang 0.5.23's real FlashInferAttnBackend (`init_forward_metadata`, its real prefill indices
updater, `forward_extend`) on CPU under TRITON_INTERPRET=1, with torch stand-ins for flashinfer's
CUDA wrappers (tests/harness/flashinfer_backend.py; every test using one names it), against the
dense position-masked reference: the hooks (patches/sglang/attention/flashinfer_backend.py) run a
batch holding a sparse request as its split view on the paged path; the ragged path would read a
later run's prefix before this pass's KV is saved. The stand-ins are first checked against the
reference on ordinary batches through SGLang's own metadata, on both of its paths."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from semblend_sglang.patches.sglang.attention.split_view import split_view_of
from tests.harness.attention_backend import ATOL, reference
from tests.sparse_extend_batches import random_batch
from tests.triton_mode import run_interpreted, triton_interpreted

pytest.importorskip("sglang")
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

INTERPRETED = triton_interpreted()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_tests_under_the_interpreter's child process"
)
CHILD_TESTS = 25  # tests the child must pass (every needs_interpreter case plus the rest)
HEADS = [(2, 1), (2, 2), (4, 1), (6, 2)]
SPARSE_KINDS = ("sparse_runs", "cold", "exact", "sparse_chunk", "sparse")


def test_tests_under_the_interpreter():
    """Run this module's tests in a child started with TRITON_INTERPRET=1 (the metadata code
    runs SGLang's Triton index kernels)."""
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    run_interpreted(__file__, CHILD_TESTS)


@pytest.fixture
def sglang_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Any:
    """sglang's flashinfer_backend module with the merge_state stand-in (flashinfer's CUDA
    merge is not imported on a CPU machine)."""
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    import sglang.srt.layers.attention.flashinfer_backend as module

    from tests.harness import flashinfer_backend

    monkeypatch.setattr(module, "_safe_merge_state", flashinfer_backend.merge_state, raising=False)
    return module


@pytest.fixture
def hooks(sglang_flashinfer: Any) -> Iterator[Any]:
    from semblend_sglang.patches.sglang.attention import backends, flashinfer_backend

    backends.install_attention_hooks(triton=False, gpu_backends=("flashinfer",))
    try:
        assert backends.hooks_installed("flashinfer")
        yield flashinfer_backend
    finally:
        backends.remove_attention_hooks()


def _sparse(seed: int, page_size: int, **kw: Any) -> Any:
    from tests.harness import flashinfer_backend

    fields = {
        "n_requests": 5,
        "min_len": 12,
        "max_len": 64,
        "heads": HEADS[seed % 4],
        "kinds": SPARSE_KINDS,
    }
    batch = random_batch(seed, **{**fields, **kw})
    return flashinfer_backend.paged(batch, page_size, seed)


# ---------------------------------------------------------------------- the stand-ins alone
@needs_interpreter
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("use_paged", [False, True])
def test_ordinary_batches_match_reference_flashinfer_paged_ragged_merge_standin(
    sglang_flashinfer: Any, page_size: int, use_paged: bool
):
    """No hooks, ordinary batches (cold, exact hit): SGLang's own metadata on its ragged path
    (ragged + paged-prefix + merge stand-ins) and on its paged path (paged stand-in) equal the
    dense reference, so the stand-ins compute what the reference does."""
    from tests.harness import flashinfer_backend as fi

    for seed in range(3):
        batch = fi.paged(
            random_batch(
                seed, n_requests=4, max_len=48, heads=HEADS[seed], kinds=("cold", "exact")
            ),
            page_size,
            seed,
        )
        backend = fi.flashinfer(batch, page_size)
        backend.use_paged = use_paged
        out = fi.forward(backend, batch)
        assert backend.forward_metadata.use_ragged is not use_paged
        torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)


def test_paged_standin_reads_pages_and_last_page_len_flashinfer_paged_standin():
    """The paged stand-in at page size 4 (SGLang plans flashinfer at page size 1): two requests
    over shuffled pages with partial last pages, bottom-right causal, against attention
    computed densely here."""
    from tests.harness.flashinfer_backend import PagedPrefill

    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, 4, 2, 8, generator=g)
    v = torch.randn(6, 4, 2, 8, generator=g)
    q = torch.randn(5, 4, 8, generator=g)
    wrapper = PagedPrefill()
    # request 0: pages 3, 1 (kv_len 4 + 2 = 6), 3 queries; request 1: pages 5, 0, 2 (kv 11), 2 q
    wrapper.plan(
        torch.tensor([0, 3, 5]),
        torch.tensor([0, 2, 5]),
        torch.tensor([3, 1, 5, 0, 2]),
        torch.tensor([2, 3]),
        4,
        2,
        8,
        4,
    )
    out = wrapper.forward(q, (k, v), causal=True, sm_scale=0.5)
    for qs, pages, kv_len in (((0, 3), [3, 1], 6), ((3, 5), [5, 0, 2], 11)):
        keys = k[pages].reshape(-1, 2, 8)[:kv_len].repeat_interleave(2, dim=1)
        vals = v[pages].reshape(-1, 2, 8)[:kv_len].repeat_interleave(2, dim=1)
        qq = q[qs[0] : qs[1]]
        s = torch.einsum("qhd,khd->hqk", qq.double(), keys.double()) * 0.5
        lq = qq.shape[0]
        visible = torch.arange(kv_len)[None, :] <= torch.arange(lq)[:, None] + kv_len - lq
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        expected = torch.einsum("hqk,khd->qhd", p, vals.double()).float()
        torch.testing.assert_close(out[qs[0] : qs[1]], expected, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------ the hooks
@needs_interpreter
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_sparse_batches_match_reference_flashinfer_paged_standin(
    hooks: Any, page_size: int, seed: int
):
    """Mixed batches (sparse of a few long runs and of many short ones, cold, exact hit, sparse
    non-final chunk; GQA and MHA): SGLang's metadata and forward_extend over the split view on
    the paged path equal the dense reference; the ragged wrapper is never planned or run."""
    from tests.harness import flashinfer_backend as fi

    batch = _sparse(seed, page_size)
    backend = fi.flashinfer(batch, page_size)
    out = fi.forward(backend, batch)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)
    assert backend.forward_metadata.use_ragged is False
    assert backend.prefill_wrapper_ragged.plans == [] and backend.prefill_wrapper_ragged.runs == 0
    paged = backend.prefill_wrappers_paged[0]
    assert [r["causal"] for r in paged.runs] == [True]
    plan = paged.plans[-1]
    seqs = split_view_of(fi.extend_batch(batch)).sequences
    assert plan["qo_indptr"].numel() == len(seqs.seq) + 1 > batch.seq_lens.numel() + 1


@needs_interpreter
def test_ordinary_batch_keeps_sglangs_ragged_choice_flashinfer_standin(hooks: Any):
    """No sparse request: the hooked backend takes SGLang's own (ragged) path and gives exactly
    the unhooked backend's output."""
    from tests.harness import flashinfer_backend as fi

    batch = random_batch(7, n_requests=3, max_len=40, heads=(4, 2), kinds=("exact", "cold"))
    hooked = fi.flashinfer(batch)
    out = fi.forward(hooked, batch)
    assert hooked.forward_metadata.use_ragged is True
    assert hooked.prefill_wrapper_ragged.runs == 1
    cls = type(hooked)
    shipped = fi.flashinfer(batch)
    fb = fi.extend_batch(batch)
    cls.init_forward_metadata.__wrapped__(shipped, fb)  # SGLang's original, unhooked
    q = batch.q.reshape(batch.q.shape[0], -1)
    layer = fi.layer(batch)
    expected = cls.forward_extend.__wrapped__(shipped, q, batch.k, batch.v, layer, fb)
    expected = expected.view_as(batch.q)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)


@needs_interpreter
def test_without_the_hooks_a_sparse_batch_is_wrong_flashinfer_standin(sglang_flashinfer: Any):
    """SGLang alone reads a sparse request as one contiguous extend after [0, m): the output
    differs from the reference, so the hooked tests can fail."""
    from tests.harness import flashinfer_backend as fi

    batch = _sparse(1, 16)
    out = fi.forward(fi.flashinfer(batch, 16), batch)
    assert (out - reference(batch)).abs().max() > 1e-3


@needs_interpreter
@pytest.mark.parametrize("page_size", [1, 16])
def test_split_view_on_the_ragged_path_is_wrong_flashinfer_ragged_merge_standin(
    sglang_flashinfer: Any, page_size: int
):
    """The pitfall the hooks avoid: the split view given to SGLang's ragged path (fresh k/v
    causal + paged prefix, KV saved after) reads a later run's prefix before this pass's KV
    of the earlier runs is in the pool (the pool holds stale KV there), so it is wrong."""
    from semblend_sglang.patches.sglang.attention.split_view import split_view_of
    from tests.harness import flashinfer_backend as fi

    batch = _sparse(2, page_size, kinds=("sparse_runs",) * 3, n_requests=3)
    fb = fi.extend_batch(batch)
    view = split_view_of(fb).batch
    backend = fi.flashinfer(batch, page_size, max_bs=16)
    backend.init_forward_metadata(view)
    assert backend.forward_metadata.use_ragged is True
    q = batch.q.reshape(batch.q.shape[0], -1)
    out = backend.forward_extend(q, batch.k, batch.v, fi.layer(batch), view).view_as(batch.q)
    assert (out - reference(batch)).abs().max() > 1e-3


@needs_interpreter
def test_more_runs_than_the_request_pool_has_rows_flashinfer_paged_standin(hooks: Any):
    """SGLang sizes kv_indptr / qo_indptr / kv_last_page_len by the request pool; the hook lends
    the indices updater larger ones for the view and puts its own back."""
    from tests.harness import flashinfer_backend as fi

    batch = _sparse(3, 16, kinds=("sparse",) * 3, n_requests=3, max_len=64)
    backend = fi.flashinfer(batch, 16, max_bs=2)
    updater = backend.indices_updater_prefill
    before = (updater.kv_indptr, updater.qo_indptr, updater.kv_last_page_len)
    firsts = (updater.kv_indptr[0], updater.qo_indptr[0])
    out = fi.forward(backend, batch)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)
    assert len(backend.prefill_wrappers_paged[0].plans[-1]["qo_indptr"]) > 3
    assert (updater.kv_indptr, updater.qo_indptr, updater.kv_last_page_len) == before
    assert (updater.kv_indptr[0], updater.qo_indptr[0]) == firsts
    assert backend.kv_indptr is updater.kv_indptr and bool((backend.kv_last_page_len == 1).all())


@needs_interpreter
def test_the_real_batch_is_left_unchanged_flashinfer_paged_standin(hooks: Any):
    from semblend_sglang.patches.sglang.attention.split_view import NOTES_ATTR
    from tests.harness import flashinfer_backend as fi

    kept = (NOTES_ATTR,)  # what the hooks keep on the batch
    batch = _sparse(0, 16)
    fb = fi.extend_batch(batch)
    before = {k: v for k, v in vars(fb).items() if k not in kept}
    snapshot = {k: v.clone() for k, v in before.items() if isinstance(v, torch.Tensor)}
    fi.forward(fi.flashinfer(batch, 16), batch, fb=fb)
    after = {k: v for k, v in vars(fb).items() if k not in kept}
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key] is value, key
        if key in snapshot:
            assert torch.equal(after[key], snapshot[key]), key


@needs_interpreter
@pytest.mark.parametrize("what", ["sliding_window", "cross", "encoder_only", "config", "metadata"])
def test_hooks_refuse_what_the_split_view_cannot_carry_flashinfer_standin(hooks: Any, what: str):
    from sglang.srt.layers.attention.flashinfer_backend import WrapperDispatch
    from sglang.srt.layers.radix_attention import AttentionType

    from tests.harness import flashinfer_backend as fi

    batch = _sparse(5, 16, n_requests=2, kinds=("sparse", "cold"))
    backend = fi.flashinfer(batch, 16)
    fb = fi.extend_batch(batch)
    layer_kw: dict[str, Any] = {}
    if what == "sliding_window":
        layer_kw["sliding_window_size"] = 8
    elif what == "cross":
        layer_kw["is_cross_attention"] = True
    elif what == "encoder_only":
        layer_kw["attn_type"] = AttentionType.ENCODER_ONLY
    elif what == "config":
        backend.dispatch_reason = WrapperDispatch.SLIDING_WINDOW
        assert not hooks.flashinfer_supported(backend)
    with pytest.raises(hooks.SparseExtendUnsupported, match="flashinfer"):
        if what == "metadata":  # forward_extend with metadata SGLang built for the real batch
            backend.init_forward_metadata(fi.extend_batch(random_batch(0, kinds=("cold",))))
            q = batch.q.reshape(batch.q.shape[0], -1)
            backend.forward_extend(q, batch.k, batch.v, fi.layer(batch), fb)
        else:
            fi.forward(backend, batch, fb=fb, **layer_kw)


def test_supported_configurations(sglang_flashinfer: Any):
    """flashinfer_supported: False for what only flashinfer refuses (the common refusals are
    tests/test_backend_contract.py's); with them (backends.backend_serves), never raising."""
    from sglang.srt.layers.attention.flashinfer_backend import WrapperDispatch

    from semblend_sglang.patches.sglang.attention.backends import backend_serves
    from semblend_sglang.patches.sglang.attention.flashinfer_backend import (
        HOOKED,
        flashinfer_supported,
    )
    from tests.harness import flashinfer_backend as fi

    batch = random_batch(0, n_requests=2, kinds=("cold",))
    assert flashinfer_supported(fi.flashinfer(batch))
    for name, value in [
        ("dispatch_reason", WrapperDispatch.CROSS_ATTENTION),
        ("enable_mis", True),
        ("is_dllm_model", True),
        ("prefill_uses_dequant_workspace", True),
        ("skip_prefill", True),
        ("num_wrappers", 2),
    ]:
        backend = fi.flashinfer(batch)
        setattr(backend, name, value)
        assert not flashinfer_supported(backend), name

    class Broken:
        @property
        def skip_prefill(self) -> bool:
            raise RuntimeError("boom")

    assert backend_serves(HOOKED, Broken()) is False
