"""Sparse-extend hooks for sglang 0.5.23's ``FlashAttentionBackend`` (``--attention-backend fa3``,
SGLang's default on Hopper).

Its extend writes this pass's KV into the pool (``set_kv_buffer``) and then calls
``flash_attn_with_kvcache`` over the pool through ``page_table``/``cache_seqlens``/
``cu_seqlens_q`` with a bottom-right causal mask: exactly an ordinary request with prefix ``s``
and extend ``e - s`` per computed run. So ``init_forward_metadata`` and ``forward_extend`` get the
batch's split view (:mod:`.split_view`) and SGLang's own metadata code and kernel do the rest, at
any page size (the page table is the request's row, strided by page).

Declined (:func:`fa3_supported` False, beside :mod:`.backends`'s common refusals, so plans are
refused before any copy): FA4 (``fa_impl_ver`` 4, a different kernel), sliding-window or
chunked-local attention, an encoder-decoder model, context parallelism, KV sharding, and
embedding mode's cache-less prefill.
"""

from __future__ import annotations

from typing import Any

from .hook_kit import HookedBackend


def fa3_supported(backend: Any) -> bool:
    """True iff this ``FlashAttentionBackend`` instance has none of fa3's own refusals (FA4,
    cache-less prefill, sliding window, local or cross attention, CP, KV sharding). Read through
    :func:`.backends.backend_serves`."""
    return (
        getattr(backend, "fa_impl_ver", 3) == 3
        and not getattr(backend, "fa_skip_kv_cache", False)
        and not getattr(backend, "has_swa", False)
        and not getattr(backend, "is_prefill_aware_swa", False)
        and getattr(backend, "local_attn_builder", None) is None
        and not getattr(backend, "is_encoder_decoder", False)
        and getattr(backend, "attn_cp_size", 1) == 1
        and getattr(backend, "_kv_shard_pool", None) is None
    )


HOOKED = HookedBackend(
    "fa3",
    "sglang.srt.layers.attention.flashattention_backend",
    "FlashAttentionBackend",
    fa3_supported,
)
