"""KV-cache layouts the transfer accepts, each seen as per-layer [blocks, block_size, heads, dim].

SGLang's MHATokenToKVPool keeps one [slots, kv_heads, head_dim] tensor per layer for K and one
for V: that is block_size 1. vLLM's paged caches keep one tensor per layer holding K and V:
FlashAttention ``[2, num_blocks, block_size, kv_heads, head_size]`` and FlashInfer
``[num_blocks, 2, block_size, kv_heads, head_size]``, each possibly a permuted (HND) view; a
slot is ``block_id * block_size + offset``. vLLM 0.32 hands connectors one packed 4-D view per
layer, ``[num_blocks, kv_heads, block_size, 2 * head_size]``: its GPU backends read K and V as the
two halves of the last axis (``vllm_packed``); its CPU backend reads each (block, head) page as
``block_size`` keys followed by ``block_size`` values (``vllm_cpu``). This module only builds
views and checks arguments; it never copies or writes cache memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from semblend_sglang.kernels.rope_spec import RopeSpec
from semblend_sglang.kernels.rotate_ref import MAX_ABS_DELTA

PagedLayout = Literal["flash_attn", "flashinfer", "vllm_packed", "vllm_cpu"]
"""Paged layouts: FlashAttention puts the K/V axis first, FlashInfer second; the vLLM 0.32 packed
4-D view splits its last axis (GPU backends) or each page (CPU backend) into K and V."""
PAGED_LAYOUTS: tuple[str, ...] = ("flash_attn", "flashinfer", "vllm_packed", "vllm_cpu")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPE = torch.float8_e4m3fn


class SlotOverlapError(ValueError):
    """Source and destination slots overlap, or a destination slot repeats."""


@dataclass(frozen=True)
class BlockCaches:
    """Validated per-layer K and V views [blocks, block_size, heads, dim] of one cache.

    ``cache_dtype`` is the logical element type (fp32/fp16/bf16 or float8_e4m3fn, whose
    storage may be uint8); ``k_scales`` [layers] fp32 are the per-layer K dequant scales
    (ones when the cache is not fp8). All views share shape, strides, dtype and device.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    cache_dtype: torch.dtype
    k_scales: torch.Tensor

    @property
    def num_slots(self) -> int:
        """Addressable slots: blocks * block_size."""
        return int(self.k[0].shape[0] * self.k[0].shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k[0].shape[1])

    @property
    def is_fp8(self) -> bool:
        return self.cache_dtype == FP8_DTYPE


def sglang_views(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SGLang per-layer [slots, kv_heads, head_dim] buffers as [slots, 1, heads, dim] views."""
    for name, bufs in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
        for i, buf in enumerate(bufs):
            if buf.dim() != 3:
                raise ValueError(
                    f"{name}[{i}] has shape {tuple(buf.shape)}; only the default "
                    "[slots, kv_heads, head_dim] MHATokenToKVPool layout is supported"
                )
    return [b.unsqueeze(1) for b in k_buffers], [b.unsqueeze(1) for b in v_buffers]


def paged_views(
    kv_caches: Sequence[torch.Tensor], layout: PagedLayout, block_size: int | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer paged caches in ``layout`` as K and V [blocks, block_size, heads, dim] views."""
    if layout not in PAGED_LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {', '.join(PAGED_LAYOUTS)}")
    ks, vs = [], []
    for i, kv in enumerate(kv_caches):
        if layout in ("vllm_packed", "vllm_cpu"):
            k, v = _packed_views(kv, layout, i)
        else:
            kv_axis = 0 if layout == "flash_attn" else 1
            if kv.dim() != 5 or kv.shape[kv_axis] != 2:
                want = "[2, blocks, block_size, heads, dim]"
                if layout == "flashinfer":
                    want = "[blocks, 2, block_size, heads, dim]"
                raise ValueError(f"kv_caches[{i}] has shape {tuple(kv.shape)}; {layout} is {want}")
            k, v = kv.select(kv_axis, 0), kv.select(kv_axis, 1)
        if block_size is not None and k.shape[1] != block_size:
            raise ValueError(f"kv_caches[{i}] block_size {k.shape[1]} != {block_size}")
        ks.append(k)
        vs.append(v)
    return ks, vs


def _packed_views(kv: torch.Tensor, layout: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [blocks, block_size, heads, dim] views of one vLLM 0.32 packed 4-D layer cache."""
    if kv.dim() != 4 or kv.shape[3] % 2:
        raise ValueError(
            f"kv_caches[{i}] has shape {tuple(kv.shape)}; {layout} is "
            "[blocks, heads, block_size, 2 * head_size]"
        )
    blocks, heads, block, both = kv.shape
    dim = both // 2
    if layout == "vllm_packed":
        page = kv.transpose(1, 2)
        return page[..., :dim], page[..., dim:]
    if kv.stride(3) != 1 or kv.stride(2) != both:
        raise ValueError(
            f"kv_caches[{i}] strides {kv.stride()}: vllm_cpu needs each (block, head) page "
            "contiguous (vLLM's LBHNC layout)"
        )
    split = kv.view(blocks, heads, 2 * block, dim)
    return split[:, :, :block].transpose(1, 2), split[:, :, block:].transpose(1, 2)


def block_caches(
    k: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    spec: RopeSpec,
    cache_dtype: torch.dtype | None = None,
    k_scales: Sequence[float] | torch.Tensor | None = None,
) -> BlockCaches:
    """Check per-layer 4-D K/V views against each other and the spec; returns BlockCaches."""
    if not k or len(k) != len(v):
        raise ValueError(f"need one K and one V tensor per layer, got {len(k)} and {len(v)}")
    ref = k[0]
    for i, t in enumerate([*k, *v]):
        if t.shape != ref.shape or t.stride() != ref.stride():
            raise ValueError(
                f"cache tensor {i} has shape {tuple(t.shape)} strides {t.stride()}; "
                f"expected {tuple(ref.shape)} strides {ref.stride()} like layer 0's K"
            )
        if t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError(f"cache tensor {i} is {t.dtype} on {t.device}, not {ref.dtype}")
    if ref.stride(3) != 1:
        raise ValueError(f"head_dim must be contiguous, got strides {ref.stride()}")
    if ref.shape[3] != spec.head_dim:
        raise ValueError(f"cache head_dim {ref.shape[3]} != spec.head_dim {spec.head_dim}")
    dtype = cache_dtype if cache_dtype is not None else ref.dtype
    if dtype == FP8_DTYPE:
        if ref.dtype not in (torch.uint8, FP8_DTYPE):
            raise TypeError(f"fp8 cache must be stored as uint8 or float8_e4m3fn, not {ref.dtype}")
    elif dtype in FLOAT_DTYPES:
        if ref.dtype != dtype:
            raise TypeError(f"cache storage {ref.dtype} does not match cache_dtype {dtype}")
    else:
        raise TypeError(f"cache dtype {dtype} is not supported (fp32/fp16/bf16/float8_e4m3fn)")
    n_layers = len(k)
    if k_scales is None:
        scales = torch.ones(n_layers, dtype=torch.float32, device=ref.device)
    else:
        if dtype != FP8_DTYPE:
            raise ValueError("k_scales applies only to an fp8 cache")
        scales = torch.as_tensor(k_scales, dtype=torch.float32).to(ref.device).reshape(-1)
        if scales.numel() != n_layers:
            raise ValueError(f"k_scales has {scales.numel()} values for {n_layers} layers")
    return BlockCaches(tuple(k), tuple(v), dtype, scales)


def check_slots(
    caches: BlockCaches,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
) -> None:
    """Raise unless src/dst/deltas are int [n] on the cache device, slots are in range,
    destination slots are unique, no destination is also a source, and |delta| < 2**24.

    One host synchronization on an accelerator (the result of all checks is read once).
    """
    n = src_slots.shape[0] if src_slots.dim() == 1 else -1
    device = caches.k[0].device
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots), ("deltas", deltas)):
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name} must be 1-D of the same length, got {tuple(t.shape)}")
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the cache on {device}")
    if n == 0:
        return
    both = torch.cat([dst_slots.to(torch.int64), src_slots.to(torch.int64)])
    out_of_range = (both.min() < 0) | (both.max() >= caches.num_slots)
    big_delta = deltas.abs().max() >= MAX_ABS_DELTA
    dst_sorted = torch.sort(dst_slots.to(torch.int64)).values
    dup_dst = (dst_sorted[1:] == dst_sorted[:-1]).any()
    overlap = torch.isin(src_slots, dst_slots).any()
    flags = torch.stack([out_of_range, big_delta, dup_dst, overlap]).tolist()
    if flags[0]:
        raise ValueError(f"slot out of range [0, {caches.num_slots})")
    if flags[1]:
        raise ValueError(f"|delta| must be < {MAX_ABS_DELTA}")
    if flags[2]:
        raise SlotOverlapError("dst_slots contains a slot more than once")
    if flags[3]:
        raise SlotOverlapError("src_slots and dst_slots overlap")
