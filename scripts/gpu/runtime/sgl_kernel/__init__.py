"""Torch stand-in for ``sgl_kernel`` on a CUDA host that cannot load the real package.

sglang 0.5.23 pins sglang-kernel 0.4.10, built for torch 2.14.1; on the GPU host's torch 2.11 its
library leaves torch symbols unresolved and cannot load (docs/gpu-kit.md). Under ``is_cuda()``
sglang imports a fixed set of names from ``sgl_kernel`` at module import time, without a
fallback. This package exposes exactly those names (tests/test_gpu_kit.py holds the list to what
the installed sglang imports):

- the ops a dense Llama/Qwen2 forward may reach when a fused op is not sent to ``forward_native``
  (norms, gated activations, sampling renormalization): torch implementations of each kernel's
  documented contract, computed as sglang's own ``forward_native`` / torch sampling path computes
  it (float32 inside, result in the input dtype, in-place where the kernel is in-place);
- everything else (int8 GEMM, MoE reductions; ``kvcacheio`` and ``quantization`` submodules):
  stubs that raise :class:`StandInKernelError` naming themselves, because no dense
  bf16 model on this path calls them and a silent wrong answer is worse than a loud failure.

Every call is counted in :data:`CALLS` (name -> count) so a run can report which stand-ins ran.
A name sglang asks for that is not here raises ImportError, as the real package would; the
name is remembered in :data:`MISSING` so a test can report it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn.functional as F

IS_SEMBLEND_GPU_STANDIN = True
__version__ = "0.0.0+semblend.gpu.standin"

CALLS: Counter[str] = Counter()
"""How often each stand-in was called in this process (name -> count)."""

MISSING: set[str] = set()
"""Names looked up on this package that it does not define (each raised AttributeError)."""

TORCH_OPS = (
    "rmsnorm",
    "fused_add_rmsnorm",
    "gemma_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
)
"""Top-level names implemented in torch."""

RAISING_STUBS = ("int8_scaled_mm", "moe_sum", "moe_sum_reduce")
"""Top-level names that raise :class:`StandInKernelError` when called."""


class StandInKernelError(NotImplementedError):
    """A kernel with no torch implementation in the stand-in was called."""


def make_raising_stub(qualname: str) -> Callable[..., NoReturn]:
    """A function named ``qualname`` that counts its call and raises StandInKernelError.

    The message names the kernel and says why it has no implementation here.
    """

    def stub(*_args: Any, **_kwargs: Any) -> NoReturn:
        CALLS[qualname] += 1
        raise StandInKernelError(
            f"sgl_kernel.{qualname} was called, but sgl_kernel here is semblend-sglang's GPU "
            "stand-in (scripts/gpu/runtime), which implements only the norm, activation and "
            "sampling ops a dense model uses; this model or feature needs the real sgl_kernel"
        )

    stub.__name__ = qualname.rsplit(".", 1)[-1]
    stub.__qualname__ = qualname
    return stub


def _rms_scale(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """``out[i] = input[i] / RMS(input) * weight[i]`` over the last dim, in float32, returned in
    ``input``'s dtype (written into ``out`` when given). ``enable_pdl`` is accepted and ignored."""
    CALLS["rmsnorm"] += 1
    x = input.to(torch.float32)
    result = (x * _rms_scale(x, eps) * weight).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * weight``.

    The sum is taken in float32 and the norm is computed from that sum (as the kernel and
    RMSNorm.forward_native do); ``residual`` receives the sum rounded to its dtype.
    """
    CALLS["fused_add_rmsnorm"] += 1
    s = input.to(torch.float32) + residual.to(torch.float32)
    residual.copy_(s)
    input.copy_(s * _rms_scale(s, eps) * weight)


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """``out[i] = input[i] / RMS(input) * (1 + weight[i])`` in float32, returned in ``input``'s
    dtype (written into ``out`` when given)."""
    CALLS["gemma_rmsnorm"] += 1
    x = input.float()
    result = (x * _rms_scale(x, eps) * (1.0 + weight.float())).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * (1 + weight)``.

    As GemmaRMSNorm.forward_native: the sum is rounded to the residual's dtype first and the norm
    is computed from the rounded sum in float32.
    """
    CALLS["gemma_fused_add_rmsnorm"] += 1
    residual.add_(input)
    x = residual.float()
    input.copy_(x * _rms_scale(x, eps) * (1.0 + weight.float()))


def _gated(
    name: str,
    act: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    CALLS[name] += 1
    d = x.shape[-1] // 2
    if x.shape[-1] != 2 * d:
        raise ValueError(f"sgl_kernel.{name}: last dim {x.shape[-1]} is not even")
    result = act(x[..., :d]) * x[..., d:]
    if out is None:
        return result
    if out.shape != result.shape:
        raise ValueError(
            f"sgl_kernel.{name}: out has shape {tuple(out.shape)}, expected {tuple(result.shape)}"
        )
    out.copy_(result)
    return out


def silu_and_mul(
    input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None
) -> torch.Tensor:
    """``silu(input[..., :d]) * input[..., d:]`` with ``d`` half the last dim (into ``out``)."""
    return _gated("silu_and_mul", F.silu, input, out)


def gelu_and_mul(
    input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None
) -> torch.Tensor:
    """``gelu(input[..., :d]) * input[..., d:]`` (exact erf GELU; into ``out`` when given)."""
    return _gated("gelu_and_mul", F.gelu, input, out)


def gelu_tanh_and_mul(
    input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None
) -> torch.Tensor:
    """``gelu_tanh(input[..., :d]) * input[..., d:]`` (tanh-approximated GELU)."""
    return _gated("gelu_tanh_and_mul", lambda t: F.gelu(t, approximate="tanh"), input, out)


def _per_row(value: torch.Tensor | float | int, rows: int, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device).reshape(-1, 1).expand(rows, 1)
    return torch.full((rows, 1), value, device=like.device)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities (by rank in a descending sort, as sglang's
    torch sampling path masks them), zero the rest and renormalize the row to sum 1.

    ``top_k`` is one int or a tensor of one value per row; a value at or above the vocabulary
    size keeps the row whole. Returns a new tensor; ``probs`` is not modified.
    """
    CALLS["top_k_renorm_prob"] += 1
    rows, vocab = probs.shape
    sorted_probs, index = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device).view(1, -1)
    sorted_probs = sorted_probs.masked_fill(rank >= _per_row(top_k, rows, probs), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, index, sorted_probs)


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep the smallest set of each row's largest probabilities whose mass reaches ``top_p``
    (sglang's torch rule: drop a token when the mass before it in the descending order exceeds
    ``top_p``), zero the rest and renormalize. ``top_p`` is one float or one per row. Returns a
    new tensor; ``probs`` is not modified.
    """
    CALLS["top_p_renorm_prob"] += 1
    rows, _ = probs.shape
    sorted_probs, index = probs.sort(dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before > _per_row(top_p, rows, probs), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, index, sorted_probs)


int8_scaled_mm = make_raising_stub("int8_scaled_mm")
moe_sum = make_raising_stub("moe_sum")
moe_sum_reduce = make_raising_stub("moe_sum_reduce")


SUBMODULES = ("kvcacheio", "quantization", "utils")
"""Submodules of the stand-in (each exposes its own exact name list)."""


def __getattr__(name: str) -> Any:
    if not name.startswith("__") and name not in SUBMODULES:
        MISSING.add(name)
    raise AttributeError(f"module 'sgl_kernel' (semblend GPU stand-in) has no attribute {name!r}")
