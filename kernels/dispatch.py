"""Public entry points: rotate_k and transfer_kv_* choose Triton on CUDA, torch elsewhere.

Off CUDA, transfer_kv_* run ``transfer_cpu`` (torch, bit-identical to the reference, faster)
and rotate_k runs the reference. ``backend`` overrides the choice: "triton" forces the kernel
(on CPU only under TRITON_INTERPRET=1, for tests), "torch" forces the reference. Every entry
point validates its arguments before touching memory; nothing here allocates or frees KV slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from semblend_sglang.kernels.kv_layouts import (
    BlockCaches,
    PagedLayout,
    block_caches,
    check_slots,
    paged_views,
    sglang_views,
)
from semblend_sglang.kernels.rope_spec import RopeSpec
from semblend_sglang.kernels.rotate_ref import rotate_k_ref
from semblend_sglang.kernels.transfer_cpu import transfer_kv_blocks_cpu
from semblend_sglang.kernels.transfer_ref import transfer_kv_blocks_ref

Backend = Literal["auto", "triton", "torch"]
"""Which implementation runs: "auto" is Triton for CUDA tensors and torch otherwise (for
transfer_kv_*, the fast path ``transfer_cpu``); "torch" is always the reference."""


def _use_triton(device: torch.device, backend: Backend) -> bool:
    if backend == "auto":
        return device.type == "cuda"
    if backend in ("triton", "torch"):
        return backend == "triton"
    raise ValueError(f"backend={backend!r}: expected 'auto', 'triton' or 'torch'")


def rotate_k(
    k: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec, *, backend: Backend = "auto"
) -> torch.Tensor:
    """Keys ``k`` [tokens, kv_heads, head_dim] rotated by position ``deltas`` [tokens] (int64).

    A key cached at position p becomes the key at p + delta. Returns a new tensor in k's dtype
    (fp32/fp16/bf16); the rotation is computed in fp32 with the spec's scaled frequencies.
    """
    if _use_triton(k.device, backend):
        from semblend_sglang.kernels.rotate_triton import rotate_k_triton

        return rotate_k_triton(k, deltas, spec)
    return rotate_k_ref(k, deltas, spec)


def _run(
    caches: BlockCaches,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
    backend: Backend,
    validate: bool,
) -> None:
    if validate:
        check_slots(caches, src_slots, dst_slots, deltas)
    if _use_triton(caches.k[0].device, backend):
        from semblend_sglang.kernels.transfer_triton import transfer_kv_blocks_triton

        transfer_kv_blocks_triton(caches, src_slots, dst_slots, deltas, spec)
    elif backend == "torch":
        transfer_kv_blocks_ref(caches, src_slots, dst_slots, deltas, spec)
    else:
        transfer_kv_blocks_cpu(caches, src_slots, dst_slots, deltas, spec)


def transfer_kv_sglang(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
    *,
    cache_dtype: torch.dtype | None = None,
    k_scales: Sequence[float] | torch.Tensor | None = None,
    backend: Backend = "auto",
    validate: bool = True,
) -> None:
    """Copy donor slots to recipient slots in every layer of an SGLang MHATokenToKVPool.

    ``k_buffers``/``v_buffers``: the pool's per-layer [slots, kv_heads, head_dim] tensors
    (``pool.k_buffer``, ``pool.v_buffer``). For layer l and token i:
    K[dst[i]] = R(deltas[i]) K[src[i]] and V[dst[i]] = V[src[i]]. ``cache_dtype`` is the
    pool's ``dtype`` when it differs from its storage (fp8 e4m3 stored as uint8), with
    ``k_scales`` the per-layer K scales (``layer.k_scale``, None meaning 1.0). With
    ``validate`` (default) raises SlotOverlapError if src and dst overlap or dst repeats, and
    ValueError for out-of-range slots, before anything is written. One Triton launch on CUDA;
    on CPU a few torch ops per layer (``transfer_cpu``), the reference with ``backend="torch"``.
    """
    k4, v4 = sglang_views(k_buffers, v_buffers)
    caches = block_caches(k4, v4, spec, cache_dtype, k_scales)
    _run(caches, src_slots, dst_slots, deltas, spec, backend, validate)


def transfer_kv_paged(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
    *,
    layout: PagedLayout = "flash_attn",
    block_size: int | None = None,
    cache_dtype: torch.dtype | None = None,
    k_scales: Sequence[float] | torch.Tensor | None = None,
    backend: Backend = "auto",
    validate: bool = True,
) -> None:
    """Same transfer for vLLM's per-layer paged caches; slot = block_id * block_size + offset.

    ``layout="flash_attn"``: [2, num_blocks, block_size, kv_heads, head_size];
    ``layout="flashinfer"``: [num_blocks, 2, block_size, kv_heads, head_size]; either may be
    a permuted (HND) view, strides are honoured. ``layout="vllm_packed"`` / ``"vllm_cpu"``: the
    packed [num_blocks, kv_heads, block_size, 2 * head_size] per-layer view vLLM 0.32 hands
    connectors, as its GPU / CPU attention backends read it (:mod:`.kv_layouts`). ``block_size``,
    when given, must match the tensors. Other arguments as in ``transfer_kv_sglang``.
    """
    k4, v4 = paged_views(kv_caches, layout, block_size)
    caches = block_caches(k4, v4, spec, cache_dtype, k_scales)
    _run(caches, src_slots, dst_slots, deltas, spec, backend, validate)
