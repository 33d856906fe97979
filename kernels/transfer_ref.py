"""Torch reference of the fused KV transfer: gather donor slots, rotate K, scatter to new slots.

Used on CPU and as the oracle for the Triton kernel. Works on validated BlockCaches views, so
one implementation serves SGLang's and vLLM's layouts. Writes only the destination slots.
"""

from __future__ import annotations

import torch

from semblend_sglang.kernels.kv_layouts import FP8_DTYPE, BlockCaches
from semblend_sglang.kernels.rope_spec import RopeSpec
from semblend_sglang.kernels.rotate_ref import rotate_fp32

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude; requantized K saturates here."""


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """fp32 values of e4m3fn codes (uint8 or float8_e4m3fn storage) times ``scale``."""
    return bits.view(FP8_DTYPE).to(torch.float32) * scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """e4m3fn codes (uint8) of ``x / scale``, saturated to +-448, rounded to nearest even."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


def transfer_kv_blocks_ref(
    caches: BlockCaches,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
) -> None:
    """For every layer: K[dst] = R(delta) K[src] and V[dst] = V[src], in place.

    Arguments must already have passed ``kv_layouts.check_slots``. K is rotated in fp32 and
    rounded once to the cache dtype; fp8 K is dequantized with its layer's scale, rotated and
    requantized with the same scale. V (and K's unrotated dims) are copied bit for bit.
    """
    bs = caches.block_size
    src = src_slots.to(torch.int64)
    dst = dst_slots.to(torch.int64)
    sb, so = src // bs, src % bs
    db, do = dst // bs, dst % bs
    for layer, (k, v) in enumerate(zip(caches.k, caches.v, strict=True)):
        k_store = k.view(torch.uint8) if caches.is_fp8 else k
        v_store = v.view(torch.uint8) if caches.is_fp8 else v
        k_rows = k_store[sb, so]
        if caches.is_fp8:
            scale = caches.k_scales[layer]
            rotated = rotate_fp32(dequantize_fp8(k_rows, scale), deltas, spec)
            new_k = quantize_fp8(rotated, scale)
            new_k[..., spec.rotary_dim :] = k_rows[..., spec.rotary_dim :]
        else:
            new_k = rotate_fp32(k_rows.to(torch.float32), deltas, spec).to(k.dtype)
        k_store[db, do] = new_k
        v_store[db, do] = v_store[sb, so]
