"""Sparse-extend hooks for sglang 0.5.23's ``FlashAttentionBackend`` (``--attention-backend fa3``,
SGLang's default on Hopper).

Its extend writes this pass's KV into the pool (``set_kv_buffer``) and then calls
``flash_attn_with_kvcache`` over the pool through ``page_table``/``cache_seqlens``/
``cu_seqlens_q`` with a bottom-right causal mask: exactly an ordinary request with prefix ``s``
and extend ``e - s`` per computed run. So ``init_forward_metadata`` and ``forward_extend`` get the
batch's split view (:mod:`.split_view`) and SGLang's own metadata code and kernel do the rest, at
any page size (the page table is the request's row, strided by page). Batches without a sparse
request go to SGLang's methods untouched.

Declined (:func:`fa3_supported` False, so plans are refused before any copy): FA4
(``fa_impl_ver`` 4, a different kernel), MLA, sliding-window or chunked-local attention, an
encoder-decoder model, context parallelism, KV sharding or unified-memory page translation, and
embedding mode's cache-less prefill. A sparse batch that still reaches CUDA-graph metadata or a
non-causal layer raises :class:`.split_hooks.SparseExtendUnsupported`.
"""

from __future__ import annotations

from typing import Any

from .split_hooks import SplitDifference, split_view_wrappers
from .wrapping import Wrappers

NAME = "fa3"


def fa3_supported(backend: Any) -> bool:
    """True iff this ``FlashAttentionBackend`` instance runs a sparse extend through the split
    view (FA3 kernel, MHA, no sliding window, local attention, cross attention, CP, KV sharding,
    page translation or cache-less prefill). Read by :func:`.attention.sparse_extend_supported`;
    never raises."""
    translator = getattr(backend, "kv_index_translator", None)
    return (
        getattr(backend, "fa_impl_ver", 3) == 3
        and not getattr(backend, "use_mla", False)
        and not getattr(backend, "fa_skip_kv_cache", False)
        and not getattr(backend, "use_sliding_window_kv_pool", False)
        and not getattr(backend, "has_swa", False)
        and not getattr(backend, "is_prefill_aware_swa", False)
        and getattr(backend, "local_attn_builder", None) is None
        and not getattr(backend, "is_encoder_decoder", False)
        and getattr(backend, "attn_cp_size", 1) == 1
        and getattr(backend, "_kv_shard_pool", None) is None
        and not getattr(translator, "is_translating", False)
    )


def fa3_wrappers(cls: type) -> Wrappers:
    """The split-view wrappers of ``cls`` (``FlashAttentionBackend``): fa3 differs in nothing but
    :func:`fa3_supported`. Installed by :func:`.attention.install_attention_hooks`."""
    return split_view_wrappers(NAME, cls, SplitDifference(fa3_supported))
