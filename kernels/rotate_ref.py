"""Torch reference of the key rotation: R(delta) applied to cached keys, computed in fp32.

The reference every Triton kernel in this package is tested against, and the path used on CPU.
"""

from __future__ import annotations

import torch

from semblend_sglang.kernels.rope_spec import RopeSpec

MAX_ABS_DELTA = 1 << 24
"""Deltas must be smaller than this in magnitude: fp32 holds them exactly."""


def rotation_angles(deltas: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """fp32 angles [tokens, rotary_dim // 2]: ``fp32(delta) * inv_freq``, as models form them."""
    inv_freq = spec.inv_freq(deltas.device)
    return deltas.to(torch.float32)[:, None] * inv_freq[None, :]


def rotation_cos_sin(deltas: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [tokens, rotary_dim // 2] of :func:`rotation_angles`, each evaluated once
    per distinct delta and gathered per token.

    Every torch rotation path takes its tables from here. Evaluated per token, a few thousand
    angles reach MKL's multithreaded ``vmsCos``/``vmsSin``, whose worker thread has returned
    other values for its share of the rows than the calling thread for the same angles
    (docs/kernels.md, "Why once per distinct delta"). A span's tokens share one delta: the
    distinct angles are few, and their cos/sin run on the calling thread.
    """
    unique, inverse = torch.unique(deltas, return_inverse=True)
    angles = rotation_angles(unique, spec)
    return angles.cos()[inverse], angles.sin()[inverse]


def rotate_fp32(x: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate fp32 keys ``x`` [tokens, heads, head_dim] by ``deltas`` [tokens]; new tensor.

    Dims from ``spec.rotary_dim`` on are copied unchanged. Does not modify ``x``.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"rotate_fp32 takes fp32 keys, got {x.dtype}")
    if x.shape[-1] != spec.head_dim:
        raise ValueError(f"key head_dim {x.shape[-1]} != spec.head_dim {spec.head_dim}")
    half = spec.rotary_dim // 2
    cos_values, sin_values = rotation_cos_sin(deltas, spec)
    cos = cos_values[:, None, :]
    sin = sin_values[:, None, :]
    out = x.clone()
    rot = x[..., : spec.rotary_dim]
    if spec.is_neox_style:
        x1, x2 = rot[..., :half], rot[..., half:]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : spec.rotary_dim] = x2 * cos + x1 * sin
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out[..., 0 : spec.rotary_dim : 2] = x1 * cos - x2 * sin
        out[..., 1 : spec.rotary_dim : 2] = x2 * cos + x1 * sin
    return out


def rotate_k_ref(k: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Keys ``k`` [tokens, kv_heads, head_dim] (fp32/fp16/bf16) rotated by ``deltas`` [tokens].

    Returns a new tensor in ``k``'s dtype; the rotation is computed in fp32 and rounded once.
    """
    check_rotate_args(k, deltas, spec)
    return rotate_fp32(k.to(torch.float32), deltas, spec).to(k.dtype)


def check_rotate_args(k: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec) -> None:
    """Shape and dtype checks shared by every rotate_k path; raises ValueError/TypeError."""
    if k.dim() != 3:
        raise ValueError(f"k must be [tokens, kv_heads, head_dim], got shape {tuple(k.shape)}")
    if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"k dtype {k.dtype} is not fp32/fp16/bf16")
    if k.shape[2] != spec.head_dim:
        raise ValueError(f"k head_dim {k.shape[2]} != spec.head_dim {spec.head_dim}")
    if deltas.dim() != 1 or deltas.shape[0] != k.shape[0]:
        raise ValueError(f"deltas must be [{k.shape[0]}], got shape {tuple(deltas.shape)}")
    if deltas.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"deltas must be int64, got {deltas.dtype}")
    if deltas.device != k.device:
        raise ValueError(f"deltas on {deltas.device}, k on {k.device}")
