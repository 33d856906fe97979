"""Triton kernel of the fused KV transfer, beside its reference ``transfer_ref``.

One launch covers every layer, K and V: program (token block, layer) reads its layer's base
addresses from int64 pointer tables (as SGLang's own KV-move kernels do), gathers the source
slots, rotates K by the per-token delta in fp32 and scatters K and V to the destination slots.
The kernel is compiled lazily, so ``TRITON_INTERPRET=1`` set before the first call (not before
import) selects the interpreter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from semblend_sglang.kernels.kv_layouts import FP8_DTYPE, BlockCaches
from semblend_sglang.kernels.rope_spec import RopeSpec

# 2*pi split so that turns * _TWO_PI_HI and turns * _TWO_PI_MID are exact for |turns| < 2**12.
_TWO_PI_HI: tl.constexpr = tl.constexpr(6.28125)
_TWO_PI_MID: tl.constexpr = tl.constexpr(0.0019354820251464844)
_TWO_PI_LO: tl.constexpr = tl.constexpr(-1.7484555314695172e-07)
_INV_TWO_PI: tl.constexpr = tl.constexpr(0.15915493667125702)

KIND_FP32, KIND_FP16, KIND_BF16, KIND_FP8 = 0, 1, 2, 3
_KINDS = {
    torch.float32: KIND_FP32,
    torch.float16: KIND_FP16,
    torch.bfloat16: KIND_BF16,
    FP8_DTYPE: KIND_FP8,
}


def _gather_rotate_scatter(
    k_src_ptrs,
    v_src_ptrs,
    k_dst_ptrs,
    v_dst_ptrs,
    witness,
    src_slots,
    dst_slots,
    deltas,
    inv_freq,
    k_scales,
    n_tokens,
    block_size,
    stride_block,
    stride_pos,
    stride_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_PASS: tl.constexpr,
    HAS_V: tl.constexpr,
    KIND: tl.constexpr,
):
    elem = witness.dtype.element_ty
    layer = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < n_tokens
    src = tl.load(src_slots + toks, mask=tmask, other=0).to(tl.int64)
    dst = tl.load(dst_slots + toks, mask=tmask, other=0).to(tl.int64)
    delta = tl.load(deltas + toks, mask=tmask, other=0)
    src_row = (src // block_size) * stride_block + (src % block_size) * stride_pos
    dst_row = (dst // block_size) * stride_block + (dst % block_size) * stride_pos
    heads = tl.arange(0, BLOCK_H)
    row_mask = tmask[:, None] & (heads < NUM_HEADS)[None, :]
    src_base = (src_row[:, None] + heads[None, :] * stride_head)[:, :, None]
    dst_base = (dst_row[:, None] + heads[None, :] * stride_head)[:, :, None]

    k_src = tl.load(k_src_ptrs + layer).to(tl.pointer_type(elem))
    k_dst = tl.load(k_dst_ptrs + layer).to(tl.pointer_type(elem))

    # Rotation angles in fp32, reduced to [-pi, pi] before cos/sin.
    j = tl.arange(0, BLOCK_R)
    jmask = j < ROT_HALF
    freq = tl.load(inv_freq + j, mask=jmask, other=0.0)
    angle = delta.to(tl.float32)[:, None] * freq[None, :]
    turns = tl.floor(angle * _INV_TWO_PI + 0.5)
    reduced = angle - turns * _TWO_PI_HI - turns * _TWO_PI_MID - turns * _TWO_PI_LO
    cos = tl.cos(reduced)[:, None, :]
    sin = tl.sin(reduced)[:, None, :]
    # Pairs side by side in a trailing axis of 2: one rotation, one encoding. NeoX halves
    # [0, R) and [R, 2R) are loaded (and stored) as two contiguous runs each; interleaved pairs
    # (2j, 2j + 1) are adjacent in memory already.
    half_mask = row_mask[:, :, None] & jmask[None, None, :]
    pair_mask = half_mask[:, :, :, None]
    if IS_NEOX:
        first = src_base + j[None, None, :]
        raw = tl.join(
            tl.load(k_src + first, mask=half_mask, other=0),
            tl.load(k_src + first + ROT_HALF, mask=half_mask, other=0),
        )
    else:
        pair_off = tl.join(2 * j, 2 * j + 1)[None, None, :, :]
        raw = tl.load(k_src + src_base[:, :, :, None] + pair_off, mask=pair_mask, other=0)
    if KIND == 3:
        scale = tl.load(k_scales + layer)
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    else:
        x = raw.to(tl.float32)
    x1, x2 = tl.split(x)
    o = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if KIND == 0:
        enc = o
    elif KIND == 1:
        enc = o.to(tl.float16)
    elif KIND == 2:
        # Round to nearest even by integer arithmetic: identical on GPU and interpreter.
        bits = o.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        enc = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        # fp32 -> e4m3fn, saturating at 448, round to nearest even (as torch converts).
        q = tl.minimum(tl.maximum(o / scale, -448.0), 448.0)
        bits = q.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)
        sub = sub - (141 << 23)
        norm = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
        enc = (tl.where(mag < (121 << 23), sub, norm) | sign).to(tl.uint8)
    if IS_NEOX:
        first = dst_base + j[None, None, :]
        e1, e2 = tl.split(enc)
        tl.store(k_dst + first, e1, mask=half_mask)
        tl.store(k_dst + first + ROT_HALF, e2, mask=half_mask)
    else:
        tl.store(k_dst + dst_base[:, :, :, None] + pair_off, enc, mask=pair_mask)

    if HAS_PASS:
        p = 2 * ROT_HALF + tl.arange(0, BLOCK_P)
        pmask = row_mask[:, :, None] & (p < HEAD_DIM)[None, None, :]
        kp = tl.load(k_src + src_base + p[None, None, :], mask=pmask, other=0)
        tl.store(k_dst + dst_base + p[None, None, :], kp, mask=pmask)

    if HAS_V:
        v_src = tl.load(v_src_ptrs + layer).to(tl.pointer_type(elem))
        v_dst = tl.load(v_dst_ptrs + layer).to(tl.pointer_type(elem))
        d = tl.arange(0, BLOCK_D)
        dmask = row_mask[:, :, None] & (d < HEAD_DIM)[None, None, :]
        vv = tl.load(v_src + src_base + d[None, None, :], mask=dmask, other=0)
        tl.store(v_dst + dst_base + d[None, None, :], vv, mask=dmask)


@functools.cache
def _compiled(interpret: bool) -> Callable[..., Any]:
    """The jitted kernel; keyed on interpreter mode because triton.jit reads it when applied."""
    del interpret
    return triton.jit(_gather_rotate_scatter)


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET is set now (the kernel then runs on CPU tensors)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


TILE_ELEMENTS = 2048
"""Elements of K (and of V) one program moves: tokens per program = this / (heads x dim).
With :data:`TILE_WARPS`: of 12 tiles swept on an H200, the best median and minimum ratio to a
plain copy over 6 shape x dtype cells (``scripts/gpu_transfer_tiles.py``, docs/perf.md
"Kernels", "GPU")."""
TILE_WARPS = 2


def tile(block_h: int, block_d: int) -> tuple[int, int]:
    """(tokens per program, warps) for a head block of ``block_h`` x ``block_d`` elements."""
    return max(1, min(64, TILE_ELEMENTS // (block_h * block_d))), TILE_WARPS


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _pointer_table(tensors: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def launch(
    k_src: tuple[torch.Tensor, ...],
    v_src: tuple[torch.Tensor, ...] | None,
    k_dst: tuple[torch.Tensor, ...],
    v_dst: tuple[torch.Tensor, ...] | None,
    cache_dtype: torch.dtype,
    k_scales: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
) -> None:
    """One kernel launch for all layers. All tensors share shape [blocks, block_size, heads,
    dim], strides, dtype and device (callers validate); ``v_*`` None moves K only."""
    ref = k_src[0]
    device = ref.device
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError("the Triton path needs CUDA tensors, or TRITON_INTERPRET=1 on CPU")
    n_tokens = int(src_slots.shape[0])
    if n_tokens == 0:
        return
    n_layers = len(k_src)
    _, block_size, num_heads, head_dim = ref.shape
    witness = ref.view(torch.uint8) if cache_dtype == FP8_DTYPE else ref
    rot_half = spec.rotary_dim // 2
    block_h, block_d = _pow2(num_heads), _pow2(head_dim)
    block_t, num_warps = tile(block_h, block_d)
    has_v = v_src is not None and v_dst is not None
    k_src_ptrs = _pointer_table(k_src, device)
    k_dst_ptrs = k_src_ptrs if k_dst is k_src else _pointer_table(k_dst, device)
    v_src_ptrs = _pointer_table(v_src, device) if has_v else k_src_ptrs
    v_dst_ptrs = (
        (v_src_ptrs if v_dst is v_src else _pointer_table(v_dst, device)) if has_v else k_dst_ptrs
    )
    grid = (triton.cdiv(n_tokens, block_t), n_layers)
    _compiled(interpreter_enabled())[grid](
        k_src_ptrs,
        v_src_ptrs,
        k_dst_ptrs,
        v_dst_ptrs,
        witness,
        src_slots.to(torch.int64),
        dst_slots.to(torch.int64),
        deltas.to(torch.int64),
        spec.inv_freq(device),
        k_scales,
        n_tokens,
        block_size,
        ref.stride(0),
        ref.stride(1),
        ref.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        ROT_HALF=rot_half,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_R=_pow2(rot_half),
        BLOCK_P=_pow2(max(1, head_dim - 2 * rot_half)),
        BLOCK_D=block_d,
        IS_NEOX=spec.is_neox_style,
        HAS_PASS=spec.rotary_dim < head_dim,
        HAS_V=has_v,
        KIND=_KINDS[cache_dtype],
        num_warps=num_warps,
    )


def transfer_kv_blocks_triton(
    caches: BlockCaches,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
) -> None:
    """Triton counterpart of ``transfer_ref.transfer_kv_blocks_ref`` (same contract)."""
    launch(
        caches.k,
        caches.v,
        caches.k,
        caches.v,
        caches.cache_dtype,
        caches.k_scales,
        src_slots,
        dst_slots,
        deltas,
        spec,
    )
