"""``sgl_kernel.utils`` of the GPU stand-in: the one name sglang 0.5.23 imports from it."""

from __future__ import annotations


def is_arch_support_pdl() -> bool:
    """False: programmatic dependent launch is a property of the real CUDA kernels; the torch
    stand-ins launch ordinary torch ops, so sglang's triton backend must not request it."""
    return False
