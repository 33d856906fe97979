"""Stand-in for ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` on hosts without the CuTe DSL.

sglang's module is the SM100 (Blackwell) dual-GEMM + SwiGLU kernel written in the CuTe DSL; it
imports ``cutlass`` at its top. :func:`semblend_gpu_runtime.activate` serves this file under
that module's name when ``cutlass`` is not installed. It defines every name sglang imports from
the real module (tests/test_gpu_kit.py checks the list against the installed sglang) and answers
that the kernel is unavailable, so ``DualGemm._select_mode`` returns None and each MLP runs its
ordinary gate/up GEMM and activation.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NoReturn

IS_SEMBLEND_STANDIN = True

MAX_DUAL_GEMM_DECODE_TOKENS = 16
"""The real module's decode-token bound (unused while the kernel is unavailable)."""


class DualGemmQuantMode(IntEnum):
    """The real module's quantization modes, same members and values."""

    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        """Every mode but UNQUANT quantizes the output."""
        return self is not DualGemmQuantMode.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        """The two dynamic modes compute the output scale at run time."""
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        """The two per-token modes keep one scale per token."""
        return self in (DualGemmQuantMode.STATIC_PER_TOKEN, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(
    num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode: Any
) -> bool:
    """False for every shape and mode: the kernel needs the CuTe DSL, which is not installed."""
    return False


def _unavailable(name: str) -> NoReturn:
    raise RuntimeError(
        f"{name}: the CuTe DSL dual GEMM is not available here (no 'cutlass' package; "
        "semblend GPU runtime stand-in); can_use_dual_gemm() answers False, so sglang should "
        "never call it"
    )


def dual_gemm_swiglu(*_args: Any, **_kwargs: Any) -> NoReturn:
    """Raises: the kernel is unavailable (see :func:`can_use_dual_gemm`)."""
    _unavailable("dual_gemm_swiglu")


def dual_gemm_swiglu_fp8(*_args: Any, **_kwargs: Any) -> NoReturn:
    """Raises: the kernel is unavailable (see :func:`can_use_dual_gemm`)."""
    _unavailable("dual_gemm_swiglu_fp8")
