"""Triton path of ``rotate_k``, beside its reference ``rotate_ref.rotate_k_ref``.

Runs the fused transfer kernel of ``transfer_triton`` with K only, one layer, from the input
tensor to a new output tensor (slot i -> slot i), so the rotation code exists exactly once.
"""

from __future__ import annotations

import torch

from semblend_sglang.kernels.rope_spec import RopeSpec
from semblend_sglang.kernels.rotate_ref import MAX_ABS_DELTA, check_rotate_args
from semblend_sglang.kernels.transfer_triton import launch


def rotate_k_triton(k: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Same contract as ``rotate_k_ref``: new tensor in ``k``'s dtype, fp32 rotation."""
    check_rotate_args(k, deltas, spec)
    if k.shape[0] and int(deltas.abs().max()) >= MAX_ABS_DELTA:
        raise ValueError(f"|delta| must be < {MAX_ABS_DELTA}")
    src = k.contiguous()
    out = torch.empty_like(src)
    slots = torch.arange(k.shape[0], dtype=torch.int64, device=k.device)
    ones = torch.ones(1, dtype=torch.float32, device=k.device)
    launch(
        (src.unsqueeze(1),),
        None,
        (out.unsqueeze(1),),
        None,
        k.dtype,
        ones,
        slots,
        slots,
        deltas,
        spec,
    )
    return out
