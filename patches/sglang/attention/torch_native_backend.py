"""Sparse-extend hooks for sglang 0.5.23's ``TorchNativeAttnBackend`` (``--attention-backend
torch_native``, the CPU server's): a batch holding a sparse request runs
:func:`extend_attention_query_only` on the real batch (SGLang's ``forward_extend`` with its SDPA
call replaced), which masks by position itself. SGLang's own SDPA extend would carry the split
view correctly (it writes the pass's KV first), but it loops over sequences, one per run, which
is slower (docs/perf-archive.md, "Split view on the CPU server: torch_native"). With the CPU
runtime's query-only extend on (:func:`.backends.install_cpu_query_only_extend`), every extend
batch runs the query-only extend.
"""

from __future__ import annotations

from typing import Any

import torch

from semblend_sglang.kernels.sparse_extend import ExtendRows, extend_attention_query_only

from ..wrapping import Wrappers
from .hook_kit import (
    HookedBackend,
    Serves,
    SparseExtendUnsupported,
    SparsePath,
    count_sparse_batch,
    is_plain_extend,
)
from .split_view import batch_lens, is_sparse_batch, notes_of

_every_extend = False
"""Whether every extend batch runs query-only (:func:`set_query_only_every_extend`)."""


def query_positions(forward_batch: Any) -> tuple[torch.Tensor, bool] | None:
    """(position of every computed token, batch is sparse), or None when they cannot be known.

    Ordinary requests get ``arange(m, n)`` (SGLang's own query placement); sparse requests get
    their segment of ``forward_batch.positions``, which must then be 1-D with one entry per
    computed token. None for a batch that is not EXTEND/MIXED, has encoder lens, lacks the length
    fields, or has a sparse request without usable positions. Read by the position-mask paths.
    """
    if not is_plain_extend(forward_batch) or forward_batch.encoder_lens is not None:
        return None
    lens = batch_lens(forward_batch)
    if lens is None:
        return None
    prefix, extend, seq = lens
    sparse = [m + c != n for m, c, n in zip(prefix, extend, seq, strict=True)]
    positions = forward_batch.positions
    if any(sparse) and (
        positions is None or positions.dim() != 1 or positions.shape[0] != sum(extend)
    ):
        return None
    device = forward_batch.seq_lens.device
    parts, start = [], 0
    for m, c, is_sparse in zip(prefix, extend, sparse, strict=True):
        if is_sparse:
            parts.append(positions[start : start + c].to(device=device, dtype=torch.int64))
        else:
            parts.append(torch.arange(m, m + c, device=device, dtype=torch.int64))
        start += c
    qpos = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
    return qpos, any(sparse)


def _cached_positions(forward_batch: Any) -> tuple[torch.Tensor, bool] | None:
    """query_positions, computed once per forward batch (forward_extend runs once per layer) and
    kept in its notes while its length fields are the same objects."""
    notes = notes_of(forward_batch)
    if notes.positions is None:
        notes.positions = query_positions(forward_batch)
    return notes.positions


def torch_native_wrappers(native: type, serves: Serves) -> Wrappers:
    """Wrappers of ``native`` (``TorchNativeAttnBackend``) ``forward_extend`` and
    ``_run_sdpa_forward_extend``, built from the current originals: a batch holding a sparse
    request (every extend batch under :func:`set_query_only_every_extend`) runs SGLang's
    ``forward_extend`` with the SDPA call replaced by the query-only extend on an instance
    ``serves`` accepts; anything else keeps SGLang's path. Installed by
    :func:`.backends.install_attention_hooks`."""
    forward_extend = native.forward_extend
    run_sdpa = native._run_sdpa_forward_extend

    def query_only(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        info = _cached_positions(forward_batch)
        if info is None and is_sparse_batch(forward_batch):
            raise SparseExtendUnsupported("torch_native: sparse extend without positions")
        if info is not None and info[1]:
            count_sparse_batch(SparsePath.POSITION_MASK, forward_batch)
        self._semblend_active = info
        try:
            return forward_extend(self, q, k, v, layer, forward_batch, *args, **kw)
        finally:
            self._semblend_active = None

    def forward_extend_hook(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        if _every_extend or is_sparse_batch(forward_batch):
            return query_only(self, q, k, v, layer, forward_batch, *args, **kw)
        return forward_extend(self, q, k, v, layer, forward_batch, *args, **kw)

    def run_sdpa_hook(
        self: Any,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        active = getattr(self, "_semblend_active", None)
        eligible = (
            active is not None
            and causal
            and not is_cross_attn
            and encoder_lens is None
            and (sliding_window_size is None or sliding_window_size < 0)
            and serves(self)
        )
        if eligible:
            return extend_attention_query_only(
                query,
                k_cache,
                v_cache,
                output,
                ExtendRows(req_to_token, req_pool_indices, seq_lens, extend_seq_lens, active[0]),
                scaling=scaling,
                enable_gqa=enable_gqa,
                causal=True,
            )
        if active is not None and active[1]:
            raise SparseExtendUnsupported(
                "torch_native: sparse extend on a cross, encoder-only or sliding-window layer"
            )
        return run_sdpa(
            self,
            query,
            output,
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices,
            seq_lens,
            extend_prefix_lens,
            extend_seq_lens,
            encoder_lens,
            scaling=scaling,
            enable_gqa=enable_gqa,
            causal=causal,
            is_cross_attn=is_cross_attn,
            sliding_window_size=sliding_window_size,
        )

    return {
        (native, "forward_extend"): forward_extend_hook,
        (native, "_run_sdpa_forward_extend"): run_sdpa_hook,
    }


def set_query_only_every_extend(on: bool) -> None:
    """Run the query-only extend for every extend batch (True), or only for batches holding a
    sparse request (False). Takes effect for the next batch; hooks must be installed."""
    global _every_extend
    _every_extend = bool(on)


def query_only_every_extend() -> bool:
    """Whether the hook runs every extend batch query-only."""
    return _every_extend


HOOKED = HookedBackend(
    "torch_native",
    "sglang.srt.layers.attention.torch_native_backend",
    "TorchNativeAttnBackend",
    lambda backend: True,
    torch_native_wrappers,
)
