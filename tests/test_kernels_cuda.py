"""The Triton kernels compiled for a CUDA GPU, against their torch references on the same GPU.

Skipped where torch sees no CUDA device (CI, these CPU machines). On a GPU machine run this
module in a process of its own, without TRITON_INTERPRET: triton.jit reads that flag when it is
applied, so a process that imported the kernels under the interpreter first (the CPU kernel
tests do) would run them interpreted here too; the module then skips, saying so. Recorded runs:
docs/perf.md ("Kernels", "GPU").
"""

from __future__ import annotations

import os

import pytest
import torch

from semblend_sglang.kernels import RopeSpec, rotate_k
from semblend_sglang.kernels.rotate_ref import rotate_fp32
from tests.test_kernels_transfer import CASE_IDS, CASES, Case, assert_kernel_equals_reference
from tests.triton_mode import triton_interpreted

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        bool(os.environ.get("TRITON_INTERPRET")), reason="TRITON_INTERPRET is set: not compiled"
    ),
]

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def compiled_triton() -> None:
    """Skip when this process's triton was imported under the interpreter (see module doc)."""
    if triton_interpreted():
        pytest.skip("triton was imported under TRITON_INTERPRET in this process: run alone")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_compiled_transfer_equals_reference(case: Case) -> None:
    assert_kernel_equals_reference(case, CUDA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "spec",
    [
        RopeSpec(head_dim=128, rotary_dim=128, rope_theta=5e5),
        RopeSpec(head_dim=64, rotary_dim=32, rope_theta=1e4, is_neox_style=False),
        RopeSpec(head_dim=80, rotary_dim=40, rope_theta=1e6),
    ],
    ids=["neox-d128", "gptj-d64r32", "neox-d80r40"],
)
def test_compiled_rotate_equals_fp32_rotation(dtype: torch.dtype, spec: RopeSpec) -> None:
    """rotate_k's kernel on the GPU gives R(delta)·K of the fp32 reference, rounded once to
    the cache dtype; a delta off by one is far outside that tolerance (as in the CPU tests)."""
    gen = torch.Generator().manual_seed(spec.head_dim * 1000 + spec.rotary_dim)
    k = (torch.randn(4096, 8, spec.head_dim, generator=gen) * 4).to(dtype)
    deltas = torch.randint(-30000, 30000, (4096,), generator=gen)
    moved = rotate_k(k.to(CUDA), deltas.to(CUDA), spec, backend="triton").cpu()
    want = rotate_fp32(k.float(), deltas, spec)
    eps = torch.finfo(dtype).eps
    tol = 2 * eps * want.abs().amax(dim=-1, keepdim=True) + 1e-5
    assert moved.dtype == dtype
    assert ((moved.float() - want).abs() <= tol).all()
    assert torch.equal(moved[..., spec.rotary_dim :], k[..., spec.rotary_dim :])
    off = rotate_fp32(k.float(), deltas + 1, spec)
    assert (off - want).abs().max() > 10 * tol.max()
