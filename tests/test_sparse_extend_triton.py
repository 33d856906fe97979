"""kernels.sparse_extend_triton: sglang 0.5.23's Triton ``extend_attention_fwd`` with the sparse
metadata, under TRITON_INTERPRET=1 on CPU, against the dense reference; and the triton hooks."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from semblend_sglang.kernels.sparse_extend import extend_attention_reference
from semblend_sglang.kernels.sparse_extend_triton import (
    IS_CAUSAL,
    SKIP_PREFIX_CUSTOM_MASK,
    build_sparse_extend_metadata,
)
from tests.sparse_extend_batches import Batch, random_batch
from tests.triton_mode import triton_interpreted

pytest.importorskip("sglang")
pytest.importorskip("triton")

ATOL = 2e-5
BLOCK = 16  # BLOCK_M = BLOCK_N: small tiles, so a request's queries span several causal tiles


INTERPRETED = triton_interpreted()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_kernel_tests_under_the_interpreter's child process"
)
KERNEL_TESTS = 10  # tests the child must pass: 7 marked needs_interpreter + 3 metadata tests


def test_kernel_tests_under_the_interpreter():
    """Run this module's kernel tests in a child started with TRITON_INTERPRET=1."""
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    passed = re.search(r"(\d+) passed", child.stdout)
    assert passed is not None and int(passed.group(1)) >= KERNEL_TESTS, child.stdout[-2000:]


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


def _reference(batch: Batch) -> torch.Tensor:
    return extend_attention_reference(batch.q, batch.k_cache, batch.v_cache, *batch.args())


@needs_interpreter
@pytest.mark.parametrize("seed", range(3))
def test_kernel_with_sparse_metadata_matches_reference(
    extend_attention_fwd: Callable[..., Any], seed: int
):
    heads = [(2, 1), (2, 2), (4, 1)][seed]
    batch = random_batch(seed, n_requests=4, max_len=32, heads=heads)
    md = build_sparse_extend_metadata(*batch.args())
    out = _run(extend_attention_fwd, batch, md, skip_prefix_custom_mask=SKIP_PREFIX_CUSTOM_MASK)
    torch.testing.assert_close(out, _reference(batch), atol=ATOL, rtol=0)


@needs_interpreter
def test_is_causal_false_gives_the_same(extend_attention_fwd: Callable[..., Any]):
    """is_causal only bounds the extend loop at the diagonal tile; the mask is lower-triangular
    there, so both flags agree (module doc: why IS_CAUSAL=True misses no key)."""
    batch = random_batch(
        5, n_requests=2, min_len=34, max_len=40, heads=(1, 1), kinds=("cold", "sparse")
    )
    assert int(batch.extend_seq_lens.max()) > 2 * BLOCK  # three query tiles
    md = build_sparse_extend_metadata(*batch.args())
    a = _run(extend_attention_fwd, batch, md, skip_prefix_custom_mask=False, is_causal=True)
    b = _run(extend_attention_fwd, batch, md, skip_prefix_custom_mask=False, is_causal=False)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    torch.testing.assert_close(a, _reference(batch), atol=ATOL, rtol=0)


@needs_interpreter
def test_shipped_default_skips_the_prefix_mask(extend_attention_fwd: Callable[..., Any]):
    """With sglang's default skip_prefix_custom_mask=True every prefix key is visible: wrong for
    a sparse request (a reused key after a query's position leaks in)."""
    batch = random_batch(6, n_requests=1, max_len=32, heads=(1, 1), kinds=("sparse",))
    md = build_sparse_extend_metadata(*batch.args())
    out = _run(extend_attention_fwd, batch, md)  # default skip_prefix_custom_mask=True
    assert (out - _reference(batch)).abs().max() > 1e-3


def test_metadata_layout():
    """n = 8, row = slots 100..107, computed positions 0, 3, 5: prefix = positions 1, 2, 4 (6 and
    7 lie past the last query, never visible)."""
    req_to_token = torch.arange(100, 108, dtype=torch.int32)[None, :]
    md = build_sparse_extend_metadata(
        req_to_token,
        torch.tensor([0]),
        torch.tensor([8]),
        torch.tensor([3]),
        torch.tensor([0, 3, 5]),
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
    md = build_sparse_extend_metadata(
        req_to_token, torch.tensor([0]), torch.tensor([10]), torch.tensor([3]), torch.arange(7, 10)
    )
    assert md.kv_indices.tolist() == list(range(50, 57))
    mask = md.custom_mask.view(3, 10)
    assert bool(mask[:, :7].all()) and mask[:, 7:].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_metadata_rejects_bad_batches():
    r2t = torch.arange(8, dtype=torch.int32)[None, :]
    one = (r2t, torch.tensor([0]), torch.tensor([8]), torch.tensor([2]))
    with pytest.raises(ValueError, match="ascending"):
        build_sparse_extend_metadata(*one, torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="ascending"):
        build_sparse_extend_metadata(*one, torch.tensor([3, 8]))
    with pytest.raises(ValueError, match="packed"):
        build_sparse_extend_metadata(*one, torch.tensor([3, 5]), torch.tensor([1]))


# ------------------------------------------------------------------- the TritonAttnBackend hooks
@dataclasses.dataclass
class Metadata:
    """The fields of sglang's triton ForwardMetadata that the hook replaces (the real class has
    them: tests/test_attention_hooks.py checks; importing it here would cost seconds)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_extend_len: int
    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None


@pytest.fixture
def triton_stub(extend_attention_fwd: Callable[..., Any]) -> Any:
    """A stand-in class with TritonAttnBackend's three hooked methods, whose metadata is what
    sglang builds for an extend (prefix = row[0:m], no mask) and whose kernel is the
    interpreted extend_attention_fwd; wrapped by the module's real wrapper factory."""
    from semblend_sglang.patches.sglang import attention

    class Stub:
        def init_forward_metadata(self, fb: Any) -> None:
            m = fb.extend_prefix_lens
            rows = fb.req_pool_indices
            kv = [self.req_to_token[r, : int(p)] for r, p in zip(rows, m, strict=True)]
            self.forward_metadata = Metadata(
                qo_indptr=torch.cat([torch.zeros(1), fb.extend_seq_lens.cumsum(0)]).long(),
                kv_indptr=torch.cat([torch.zeros(1), m.cumsum(0)]).int(),
                kv_indices=torch.cat(kv).long(),
                max_extend_len=int(fb.extend_seq_lens.max()),
            )

        def init_forward_metadata_out_graph(self, fb: Any, in_capture: bool = False) -> None:
            raise AssertionError("not reached in these tests")

        def _forward_extend_kernel(self, layer: Any, *args: Any, **kw: Any) -> Any:
            return extend_attention_fwd(*args, **kw)

        def forward_extend(self, batch: Batch) -> torch.Tensor:  # sglang's call, abridged
            md = self.forward_metadata
            out = torch.full_like(batch.q, float("nan"))
            self._forward_extend_kernel(
                None,
                batch.q,
                batch.k,
                batch.v,
                out,
                batch.k_cache,
                batch.v_cache,
                md.qo_indptr,
                md.kv_indptr,
                md.kv_indices,
                md.custom_mask,
                True,
                md.mask_indptr,
                md.max_extend_len,
                1.0,
                1.0,
            )
            return out

    for (owner, name), fn in attention._triton_wrappers(Stub).items():
        setattr(owner, name, fn)
    stub = Stub()
    stub.dcp_size, stub.page_size, stub.sliding_window_size = 1, 1, None
    return stub


def _forward_batch(batch: Batch) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        extend_prefix_lens=batch.extend_prefix_lens,
        extend_prefix_lens_cpu=batch.extend_prefix_lens.tolist(),
        extend_seq_lens=batch.extend_seq_lens,
        extend_seq_lens_cpu=batch.extend_seq_lens.tolist(),
        seq_lens=batch.seq_lens,
        seq_lens_cpu=batch.seq_lens,
        req_pool_indices=batch.req_pool_indices,
        positions=batch.positions,
        encoder_lens=None,
    )


@needs_interpreter
def test_hook_declines_ordinary_batches_and_masks_sparse_ones(triton_stub: Any):
    ordinary = random_batch(7, n_requests=2, max_len=32, heads=(2, 1), kinds=("exact", "cold"))
    triton_stub.req_to_token = ordinary.req_to_token
    triton_stub.init_forward_metadata(_forward_batch(ordinary))
    assert triton_stub.forward_metadata.custom_mask is None  # sglang's metadata untouched
    out = triton_stub.forward_extend(ordinary)
    torch.testing.assert_close(out, _reference(ordinary), atol=ATOL, rtol=0)

    sparse = random_batch(8, n_requests=3, max_len=32, heads=(2, 1))
    triton_stub.req_to_token = sparse.req_to_token
    triton_stub.init_forward_metadata(_forward_batch(sparse))
    assert triton_stub.forward_metadata.custom_mask is not None
    out = triton_stub.forward_extend(sparse)
    torch.testing.assert_close(out, _reference(sparse), atol=ATOL, rtol=0)


@needs_interpreter
def test_hook_refuses_an_unsupported_configuration(triton_stub: Any):
    from semblend_sglang.patches.sglang.attention import SparseExtendUnsupported

    sparse = random_batch(9, n_requests=1, max_len=30, kinds=("sparse",))
    triton_stub.req_to_token = sparse.req_to_token
    triton_stub.dcp_size = 2
    with pytest.raises(SparseExtendUnsupported):
        triton_stub.init_forward_metadata(_forward_batch(sparse))
