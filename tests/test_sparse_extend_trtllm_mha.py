"""sglang 0.5.23's real TRTLLMHAAttnBackend (`init_forward_metadata`, `forward_extend` on SM100's
batch-context path) on CPU under TRITON_INTERPRET=1, with torch stand-ins for flashinfer's
``trtllm_batch_context_with_kv_cache`` and ``trtllm_batch_decode_with_kv_cache``
(tests/harness/flashinfer_backend.py; every test using one names it), at page sizes 16, 64 and
128, against the dense position-masked reference. The stand-ins are first checked on ordinary
batches through SGLang's own metadata."""

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
CHILD_TESTS = 24  # tests the child must pass
HEADS = [(2, 1), (2, 2), (4, 1), (6, 2)]
SPARSE_KINDS = ("sparse_runs", "cold", "exact", "sparse_chunk", "sparse")
BF16_TOL = 2**-7
"""bf16 output against the float64 reference of the same bf16 inputs: the output is rounded once
to bf16 (relative error <= 2**-9) and |output| < 4 here, so within 2**-7."""


def test_tests_under_the_interpreter():
    """Run this module's tests in a child started with TRITON_INTERPRET=1 (the page table is
    built by SGLang's Triton kernel)."""
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    run_interpreted(__file__, CHILD_TESTS)


@pytest.fixture
def sglang_trtllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """sglang's trtllm_mha_backend module calling the kernel stand-ins as ``flashinfer``."""
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    import sglang.srt.layers.attention.trtllm_mha_backend as module

    from tests.harness import flashinfer_backend

    monkeypatch.setattr(module, "flashinfer", flashinfer_backend.trtllm_kernels(), raising=False)
    return module


@pytest.fixture
def hooks(sglang_trtllm: Any) -> Iterator[Any]:
    from semblend_sglang.patches.sglang.attention import backends, trtllm_mha_backend

    backends.install_attention_hooks(triton=False, gpu_backends=("trtllm_mha",))
    try:
        assert backends.hooks_installed("trtllm_mha")
        yield trtllm_mha_backend
    finally:
        backends.remove_attention_hooks()


def _batch(seed: int, page_size: int, **kw: Any) -> Any:
    from tests.harness import flashinfer_backend

    fields = {
        "n_requests": 5,
        "min_len": 12,
        "max_len": 160,
        "heads": HEADS[seed % 4],
        "kinds": SPARSE_KINDS,
    }
    return flashinfer_backend.paged(random_batch(seed, **{**fields, **kw}), page_size, seed)


@needs_interpreter
@pytest.mark.parametrize("page_size", [16, 64])
def test_ordinary_batches_match_reference_trtllm_context_standin(
    sglang_trtllm: Any, page_size: int
):
    """No hooks, ordinary batches (cold, exact hit): SGLang's page tables, sequence lengths and
    cumulative query lengths through the context stand-in equal the dense reference."""
    from tests.harness import flashinfer_backend as fi

    for seed in range(3):
        batch = _batch(seed, page_size, n_requests=4, kinds=("cold", "exact"))
        out = fi.forward(fi.trtllm(batch, page_size), batch)
        torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)


@needs_interpreter
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("seed", range(4))
def test_sparse_batches_match_reference_trtllm_context_standin(
    hooks: Any, page_size: int, seed: int
):
    """Mixed batches with sparse requests (few long runs, many short ones), cold, exact hits and
    sparse chunks; GQA and MHA: the split view through SGLang's metadata and forward_extend
    equals the dense reference."""
    from tests.harness import flashinfer_backend as fi

    batch = _batch(seed, page_size)
    backend = fi.trtllm(batch, page_size)
    out = fi.forward(backend, batch)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=0)
    seqs = split_view_of(fi.extend_batch(batch)).sequences
    assert backend.forward_metadata.cache_seqlens_int32.tolist() == seqs.seq


def _tail_batch(page_size: int) -> Any:
    """The first seed's bf16 batch whose split view ends in a one-token run (SGLang then runs the
    trailing one-token sequences through its decode kernel)."""
    from semblend_sglang.patches.sglang.attention.split_view import split_sequences
    from tests.harness import flashinfer_backend as fi

    for seed in range(100):
        batch = _batch(
            seed,
            page_size,
            n_requests=3,
            max_len=80,
            kinds=("cold", "exact", "sparse"),
            dtype=torch.bfloat16,
        )
        seqs = split_sequences(fi.extend_batch(batch))
        if seqs is not None and seqs.extend[-1] == 1 and len(set(seqs.extend)) > 1:
            return batch
    raise AssertionError("no batch ends in a one-token run")


@needs_interpreter
def test_one_token_runs_take_the_decode_tail_trtllm_context_decode_standin(hooks: Any):
    """bf16: the view's trailing one-token runs go through SGLang's mixed decode tail (decode
    stand-in, keys [0, e)), the rest through the context stand-in; equal to the reference."""
    from tests.harness import flashinfer_backend as fi

    batch = _tail_batch(64)
    backend = fi.trtllm(batch, 64)
    out = fi.forward(backend, batch)
    assert backend.forward_metadata.mixed_prefill_reqs >= 0
    expected = reference(batch)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected.double(), atol=BF16_TOL, rtol=0)


@needs_interpreter
def test_ordinary_batch_is_sglangs_trtllm_context_standin(hooks: Any):
    """No sparse request: the hooked backend's metadata and output are the original's."""
    from tests.harness import flashinfer_backend as fi

    batch = _batch(7, 64, n_requests=3, kinds=("exact", "cold"))
    hooked = fi.trtllm(batch, 64)
    out = fi.forward(hooked, batch)
    cls = type(hooked)
    shipped = fi.trtllm(batch, 64)
    fb = fi.extend_batch(batch)
    cls.init_forward_metadata.__wrapped__(shipped, fb)
    q = batch.q.reshape(batch.q.shape[0], -1)
    expected = cls.forward_extend.__wrapped__(shipped, q, batch.k, batch.v, fi.layer(batch), fb)
    torch.testing.assert_close(out, expected.view_as(batch.q), atol=0, rtol=0)
    for name in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k"):
        a, b = getattr(hooked.forward_metadata, name), getattr(shipped.forward_metadata, name)
        assert torch.equal(a, b), name


@needs_interpreter
def test_without_the_hooks_a_sparse_batch_is_wrong_trtllm_context_standin(sglang_trtllm: Any):
    from tests.harness import flashinfer_backend as fi

    batch = _batch(1, 64)
    out = fi.forward(fi.trtllm(batch, 64), batch)
    assert (out - reference(batch)).abs().max() > 1e-3


@needs_interpreter
def test_the_real_batch_is_left_unchanged_trtllm_context_standin(hooks: Any):
    from semblend_sglang.patches.sglang.attention.split_view import NOTES_ATTR
    from tests.harness import flashinfer_backend as fi

    batch = _batch(0, 16)
    fb = fi.extend_batch(batch)
    kept = (NOTES_ATTR,)  # what the hooks keep on the batch
    before = {k: v for k, v in vars(fb).items() if k not in kept}
    snapshot = {k: v.clone() for k, v in before.items() if isinstance(v, torch.Tensor)}
    fi.forward(fi.trtllm(batch, 16), batch, fb=fb)
    after = {k: v for k, v in vars(fb).items() if k not in kept}
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key] is value, key
        if key in snapshot:
            assert torch.equal(after[key], snapshot[key]), key


@needs_interpreter
@pytest.mark.parametrize("what", ["sliding_window", "encoder_only", "fmha_v2", "fp8", "metadata"])
def test_hooks_refuse_what_the_split_view_cannot_carry_trtllm_standin(hooks: Any, what: str):
    from sglang.srt.layers.radix_attention import AttentionType

    from tests.harness import flashinfer_backend as fi

    batch = _batch(5, 16, n_requests=2, kinds=("sparse", "cold"))
    backend = fi.trtllm(batch, 16)
    fb = fi.extend_batch(batch)
    layer_kw: dict[str, Any] = {}
    if what == "sliding_window":
        layer_kw["sliding_window_size"] = 8
    elif what == "encoder_only":
        layer_kw["attn_type"] = AttentionType.ENCODER_ONLY
    elif what == "fmha_v2":
        backend.use_fmha_v2 = True
    elif what == "fp8":
        backend.data_type = torch.float8_e4m3fn
    if what in ("fmha_v2", "fp8"):
        assert not hooks.trtllm_mha_supported(backend)
    with pytest.raises(hooks.SparseExtendUnsupported, match="trtllm_mha"):
        if what == "metadata":
            backend.init_forward_metadata(fi.extend_batch(random_batch(0, kinds=("cold",))))
            q = batch.q.reshape(batch.q.shape[0], -1)
            backend.forward_extend(q, batch.k, batch.v, fi.layer(batch), fb)
        else:
            fi.forward(backend, batch, fb=fb, **layer_kw)


def test_supported_configurations(sglang_trtllm: Any):
    """trtllm_mha_supported: False for what only trtllm_mha refuses (the common refusals are
    tests/test_backend_contract.py's); with them (backends.backend_serves), never raising."""
    from semblend_sglang.patches.sglang.attention.backends import backend_serves
    from semblend_sglang.patches.sglang.attention.trtllm_mha_backend import (
        HOOKED,
        trtllm_mha_supported,
    )
    from tests.harness import flashinfer_backend as fi

    batch = random_batch(0, n_requests=2, kinds=("cold",))
    assert trtllm_mha_supported(fi.trtllm(batch, 16))
    for name, value in [
        ("use_fmha_v2", True),
        ("prefill_uses_native_fp4", True),
        ("data_type", torch.float8_e4m3fn),
        ("_swa_kv_pool", object()),
        ("skip_prefill", True),
    ]:
        backend = fi.trtllm(batch, 16)
        setattr(backend, name, value)
        assert not trtllm_mha_supported(backend), name

    class Broken:
        @property
        def skip_prefill(self) -> bool:
            raise RuntimeError("boom")

    assert backend_serves(HOOKED, Broken()) is False
