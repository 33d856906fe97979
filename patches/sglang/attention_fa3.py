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

from collections.abc import Callable
from typing import Any

from .split_hooks import (
    SparseExtendUnsupported,
    SparsePath,
    check_causal_layer,
    count_sparse_batch,
    split_batch,
)
from .split_view import is_sparse_batch

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


def fa3_wrappers(cls: type) -> dict[tuple[type, str], Callable[..., Any]]:
    """Wrappers of ``cls`` (``FlashAttentionBackend``) ``init_forward_metadata``,
    ``init_forward_metadata_out_graph`` and ``forward_extend``, built from the current
    originals. Installed by :func:`.attention.install_attention_hooks`; they never change a
    batch without a sparse request, nor the real batch of one."""
    init_metadata = cls.init_forward_metadata
    init_out_graph = cls.init_forward_metadata_out_graph
    forward_extend = cls.forward_extend

    def init_forward_metadata_hook(self: Any, forward_batch: Any) -> Any:
        view = split_batch(NAME, forward_batch)
        if view is None:
            return init_metadata(self, forward_batch)
        if not fa3_supported(self):
            raise SparseExtendUnsupported(f"{NAME}: this backend configuration cannot split")
        count_sparse_batch(SparsePath.SPLIT_VIEW, forward_batch)
        return init_metadata(self, view)

    def init_out_graph_hook(self: Any, forward_batch: Any, *args: Any, **kw: Any) -> Any:
        if is_sparse_batch(forward_batch):
            raise SparseExtendUnsupported(f"{NAME}: sparse extend under a CUDA graph")
        return init_out_graph(self, forward_batch, *args, **kw)

    def forward_extend_hook(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        view = split_batch(NAME, forward_batch)
        if view is None:
            return forward_extend(self, q, k, v, layer, forward_batch, *args, **kw)
        check_causal_layer(NAME, layer)
        return forward_extend(self, q, k, v, layer, view, *args, **kw)

    return {
        (cls, "init_forward_metadata"): init_forward_metadata_hook,
        (cls, "init_forward_metadata_out_graph"): init_out_graph_hook,
        (cls, "forward_extend"): forward_extend_hook,
    }
