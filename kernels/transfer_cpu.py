"""CPU fast path of the fused KV transfer: the reference's arithmetic in fewer, larger torch ops.

Same results as ``transfer_ref.transfer_kv_blocks_ref``, bit for bit (tested): the same fp32
angles and cos/sin values, the same rounded products and sums, one rounding to the cache dtype,
the same fp8 dequantize/requantize; V and unrotated K dims are copied as raw bits (only a NaN in
rotated K dims may come out as another NaN encoding). Only the data movement differs:

- cos/sin are computed once for all layers (not once per layer) and laid out over heads, so
  that the rotation's multiplies and adds run over contiguous memory;
- when every slot is a row of a flat view (SGLang's pool, FlashAttention NHD caches, any cache
  with block size 1), rows are gathered with one ``index_select`` and scattered with one
  ``index_copy_`` per tensor, on a view whose elements are as wide as the row allows (up to 16
  bytes), so whole words are copied; layouts whose slots do not flatten (HND views, FlashInfer
  with block size > 1) index (block, offset) like the reference;
- K's rotated dims are converted once per layer into one fp32 buffer, rotated there in place and
  rounded once back into the gathered rows (fp32 rows rotated entirely are rotated in place);
- tables, fp32 buffers and gathered rows live in per-thread scratch memory kept between calls,
  so a repeated call touches no fresh pages; tokens are moved in chunks of ``CHUNK_ELEMENTS`` K
  elements, all layers per chunk, which bounds that memory.
"""

from __future__ import annotations

import math
import threading

import torch

from semblend_sglang.kernels.kv_layouts import FP8_DTYPE, BlockCaches
from semblend_sglang.kernels.rope_spec import RopeSpec
from semblend_sglang.kernels.rotate_ref import rotation_cos_sin
from semblend_sglang.kernels.transfer_ref import FP8_MAX

_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16)
"""Element types for whole-row copies, widest first; copying them moves the bits unchanged."""

CHUNK_ELEMENTS = 1 << 20
"""Tokens are moved in chunks of at most this many K elements (tokens * heads * head_dim, at
least one token), all layers per chunk, so the kept scratch memory stays under ~25 MB whatever
the transfer's length."""


class _Scratch(threading.local):
    """Per-thread scratch memory, kept between calls and grown on demand.

    Fresh memory costs a page fault per 4 KiB page on first touch (2-5 us each on the project's
    VM) and glibc returns freed multi-MB blocks to the system, so per-call temporaries
    paid that on every call; a kept buffer pays it once per thread.
    """

    buffer: torch.Tensor | None = None

    def tensors(
        self, device: torch.device, *specs: tuple[tuple[int, ...], torch.dtype]
    ) -> list[torch.Tensor]:
        """Uninitialized, non-overlapping tensors of the given (shape, dtype), 64-byte aligned."""
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            total += -(-math.prod(shape) * dtype.itemsize // 64) * 64
        buf = self.buffer
        if buf is None or buf.device != device or buf.numel() < total:
            buf = self.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        return [
            buf[o : o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, specs, strict=True)
        ]


_SCRATCH = _Scratch()


class Rotation:
    """R(delta) for ``tokens`` tokens of ``heads`` heads, applied in place to fp32 keys.

    Writes cos, sin and -sin of ``rotate_ref.rotation_cos_sin`` (so the reference's values, bit
    for bit) into the given contiguous fp32 tables: ``cos`` [tokens, heads, rotary_dim] (the
    angle's cosine at both dims of each pair), ``sin`` and ``neg_sin`` [tokens, heads,
    rotary_dim // 2].
    """

    def __init__(
        self,
        deltas: torch.Tensor,
        spec: RopeSpec,
        cos: torch.Tensor,
        sin: torch.Tensor,
        neg_sin: torch.Tensor,
    ) -> None:
        cos_values, sin_values = (t[:, None, :] for t in rotation_cos_sin(deltas, spec))
        n, heads, half = sin.shape
        if spec.is_neox_style:
            cos.view(n, heads, 2, half).copy_(cos_values[:, :, None, :].expand(n, heads, 2, half))
        else:
            cos.view(n, heads, half, 2).copy_(cos_values[..., None].expand(n, heads, half, 2))
        sin.copy_(sin_values.expand(n, heads, half))
        torch.neg(sin_values.expand(n, heads, half), out=neg_sin)
        self.cos, self.sin, self.neg_sin = cos, sin, neg_sin
        self.neox = spec.is_neox_style

    def pairs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (x1, x2) of the pairs in ``x`` [..., rotary_dim]: NeoX halves, GPT-J even/odd."""
        if self.neox:
            half = x.shape[-1] // 2
            return x[..., :half], x[..., half:]
        return x[..., 0::2], x[..., 1::2]

    def rotate_(self, x: torch.Tensor, scratch: torch.Tensor) -> None:
        """Rotate contiguous fp32 ``x`` [tokens, heads, rotary_dim] in place; ``scratch`` like x.

        x1' = x1*cos + x2*(-sin), x2' = x2*cos + x1*sin, each product and sum rounded once in
        fp32: equal bit for bit to the reference's x1*cos - x2*sin and x2*cos + x1*sin, since
        negating a product is exact and a - b is a + (-b) in IEEE 754.
        """
        x1, x2 = self.pairs(x)
        s1, s2 = self.pairs(scratch)
        torch.mul(x2, self.neg_sin, out=s1)
        torch.mul(x1, self.sin, out=s2)
        x.mul_(self.cos)
        x.add_(scratch)


def slot_rows(t: torch.Tensor) -> torch.Tensor | None:
    """[blocks * block_size, heads, dim] view of a [blocks, block_size, heads, dim] view in which
    row i is slot i, or None when blocks and offsets do not merge into one stride (HND views)."""
    if t.shape[1] == 1:
        return t.select(1, 0)
    if t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1):
        return t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])
    return None


def wide_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [slots, heads, dim] as [slots, words] of the widest element type that tiles each
    row (heads and dims contiguous) exactly; ``rows`` itself when none does. Same memory."""
    if rows.stride(2) != 1 or (rows.shape[1] > 1 and rows.stride(1) != rows.shape[2]):
        return rows
    item = rows.element_size()
    offsets = (rows.shape[1] * rows.shape[2], rows.stride(0), rows.storage_offset())
    for dtype in _WIDE_DTYPES:
        if dtype.itemsize <= item:
            break
        if all(o * item % dtype.itemsize == 0 for o in offsets):
            return rows.flatten(1).view(dtype)
    return rows


def transfer_kv_blocks_cpu(
    caches: BlockCaches,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
) -> None:
    """For every layer: K[dst] = R(delta) K[src] and V[dst] = V[src], in place.

    Same contract and same results, bit for bit, as ``transfer_ref.transfer_kv_blocks_ref``:
    arguments must already have passed ``kv_layouts.check_slots``; only destination slots are
    written. Works on any device; dispatch uses it for non-CUDA tensors.
    """
    n = int(src_slots.shape[0])
    if n == 0:
        return
    src = src_slots.to(torch.int64)
    dst = dst_slots.to(torch.int64)
    k0 = caches.k[0]
    heads, head_dim = int(k0.shape[2]), int(k0.shape[3])
    fp8 = caches.is_fp8
    store_dtype = torch.uint8 if fp8 else k0.dtype
    flat = slot_rows(k0.view(store_dtype)) is not None  # all views share layer 0's strides
    step = max(1, CHUNK_ELEMENTS // (heads * head_dim))
    for start in range(0, n, step):
        stop = min(n, start + step)
        _transfer_chunk(caches, src[start:stop], dst[start:stop], deltas[start:stop], spec, flat)


def _transfer_chunk(
    caches: BlockCaches,
    src: torch.Tensor,
    dst: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
    flat: bool,
) -> None:
    """All layers for one chunk of tokens; int64 ``src``/``dst`` as validated."""
    n = int(src.shape[0])
    k0 = caches.k[0]
    heads, head_dim, r = int(k0.shape[2]), int(k0.shape[3]), spec.rotary_dim
    fp8 = caches.is_fp8
    value_dtype = FP8_DTYPE if fp8 else caches.cache_dtype
    store_dtype = torch.uint8 if fp8 else k0.dtype
    f32 = torch.float32
    cos, sin, neg_sin, work, scratch, k_rows, v_rows = _SCRATCH.tensors(
        k0.device,
        ((n, heads, r), f32),
        ((n, heads, r // 2), f32),
        ((n, heads, r // 2), f32),
        ((n, heads, r), f32),
        ((n, heads, r), f32),
        ((n, heads, head_dim), store_dtype),
        ((n, heads, head_dim), store_dtype),
    )
    rotation = Rotation(deltas, spec, cos, sin, neg_sin)
    # fp32 rows with every dim rotated are already the fp32 buffer rotate_ wants, if contiguous
    fp32_rows = value_dtype == f32 and r == head_dim
    if not flat:
        bs = caches.block_size
        sb, so, db, do = src // bs, src % bs, dst // bs, dst % bs
    for layer, (k_cache, v_cache) in enumerate(zip(caches.k, caches.v, strict=True)):
        k, v = k_cache.view(store_dtype), v_cache.view(store_dtype)
        if flat:
            k_wide, v_wide = wide_rows(slot_rows(k)), wide_rows(slot_rows(v))
            gathered = _gather(k_wide, src, k_rows)
            rows = gathered.view(store_dtype).view(n, heads, head_dim)
        else:
            rows = k[sb, so]
        rotated = rows.view(value_dtype)[..., :r]
        if fp32_rows and rotated.is_contiguous():  # rotated where gathered: no trip through work
            rotation.rotate_(rotated, scratch)
        else:
            work.copy_(rotated)
            if fp8:
                scale = caches.k_scales[layer]
                work.mul_(scale)
                rotation.rotate_(work, scratch)
                work.div_(scale).clamp_(-FP8_MAX, FP8_MAX)
            else:
                rotation.rotate_(work, scratch)
            rotated.copy_(work)
        if flat:
            k_wide.index_copy_(0, dst, gathered)
            v_wide.index_copy_(0, dst, _gather(v_wide, src, v_rows))
        else:
            k[db, do] = rows
            v[db, do] = v[sb, so]


def _gather(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rows.index_select(0, index)`` written into ``out``'s memory (same byte size)."""
    return torch.index_select(
        rows, 0, index, out=out.view(-1).view(rows.dtype).view(-1, *rows.shape[1:])
    )
