"""Metadata that makes SGLang's Triton ``extend_attention_fwd`` run a sparse extend.

Same batch contract as :mod:`semblend_sglang.kernels.sparse_extend` (each request's row holds a
slot for every position ``[0, n_i)``; its computed tokens are the extend part, positions
ascending; a query at position ``p`` sees every key at position ``<= p``). No sglang import.

The kernel (sglang 0.5.23 ``kernels/ops/attention/extend_attention.py``) reads, per request, a
*prefix* of ``kv_indptr``/``kv_indices`` slots from the KV pool and then the *extend* part (the
computed tokens' own K/V, passed as ``k_extend``/``v_extend``). With ``custom_mask`` and
``skip_prefix_custom_mask=False`` both parts are masked by ``custom_mask`` (uint8, row-major
``[q_len, prefix_len + q_len]`` per request, starting at ``mask_indptr[i]``). So:

- prefix = the row slots of the non-computed positions below the request's last query position,
  in position order (exact prefix + reused spans + any other cached position); prefix key ``j``
  is visible to query ``i`` iff ``pos(key j) <= pos(query i)``;
- extend key ``j`` is visible to query ``i`` iff ``j <= i`` (positions ascend).

``is_causal``: in 0.5.23 the prefix loop covers the whole prefix whatever ``is_causal`` is; with
``is_causal=True`` the extend loop stops at the query tile's diagonal (``(block_m + 1) * BLOCK_M``,
the subject of SGLang PR #39703) and applies ``custom_mask`` alone inside it. The extend-part
mask above is lower-triangular in extend index, so no visible key lies past the diagonal tile:
``is_causal=True`` misses nothing and skips the upper tiles. Both flags give the same result;
:data:`IS_CAUSAL` is the one to pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sparse_extend import ExtendRows

IS_CAUSAL = True
"""``is_causal`` for ``extend_attention_fwd`` with :class:`SparseExtendMetadata` (module doc)."""

SKIP_PREFIX_CUSTOM_MASK = False
"""``skip_prefix_custom_mask`` for ``extend_attention_fwd``: the prefix must be masked too."""


@dataclass(frozen=True)
class SparseExtendMetadata:
    """Arguments of ``extend_attention_fwd`` for one sparse extend batch (all on one device).

    ``qo_indptr`` int64 [B+1] (extend-part offsets into ``q``), ``kv_indptr`` int32 [B+1] and
    ``kv_indices`` int64 (prefix slots), ``custom_mask`` uint8 and ``mask_indptr`` int64 [B+1],
    ``max_extend_len`` the largest per-request computed count.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    max_extend_len: int


def build_sparse_extend_metadata(rows: ExtendRows) -> SparseExtendMetadata:
    """Build the kernel metadata for a batch under the module contract (any mix of requests).

    Computed tokens must be laid out request after request (``extend_start_loc`` = running sum
    of ``extend_seq_lens``, as SGLang lays them out); raises ValueError otherwise, or when a
    request's positions are not distinct, ascending and ``< n_i``, or it has no computed token.
    The outputs live on ``req_to_token``'s device.
    """
    device = rows.req_to_token.device
    lens = rows.lens()
    n_list = rows.row_lens()
    pool_rows = rows.pool_rows()
    starts = rows.packed_starts()
    if rows.extend_start_loc is not None and rows.starts() != starts[:-1]:
        raise ValueError("computed tokens must be packed request after request")
    if rows.positions.shape[0] != starts[-1]:
        raise ValueError(f"positions has {rows.positions.shape[0]} entries for {starts[-1]} tokens")
    pos_all = rows.positions.to(device=device, dtype=torch.int64)
    kv_parts: list[torch.Tensor] = []
    mask_parts: list[torch.Tensor] = []
    kv_counts: list[int] = []
    mask_counts: list[int] = []
    for i, (c, n) in enumerate(zip(lens, n_list, strict=True)):
        if c == 0:
            raise ValueError(f"request {i} has no computed token")
        pos = pos_all[starts[i] : starts[i + 1]]
        last = int(pos[-1])
        if int(pos[0]) < 0 or last >= n or bool((pos[1:] <= pos[:-1]).any()):
            raise ValueError(f"request {i}: positions must be distinct, ascending and < {n}")
        cached = torch.ones(last, dtype=torch.bool, device=device)
        cached[pos[:-1]] = False  # pos[:-1] < last
        prefix_pos = torch.nonzero(cached).flatten()
        kv_parts.append(rows.req_to_token[pool_rows[i], prefix_pos].to(torch.int64))
        prefix_mask = prefix_pos[None, :] <= pos[:, None]  # [c, p]
        extend_mask = torch.ones(c, c, dtype=torch.bool, device=device).tril_()
        mask_parts.append(torch.cat([prefix_mask, extend_mask], dim=1).flatten())
        kv_counts.append(prefix_pos.numel())
        mask_counts.append(c * (prefix_pos.numel() + c))

    def indptr(counts: list[int], dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(len(counts) + 1, dtype=dtype, device=device)
        out[1:] = torch.tensor(counts, dtype=dtype, device=device).cumsum(0)
        return out

    return SparseExtendMetadata(
        qo_indptr=indptr(lens, torch.int64),
        kv_indptr=indptr(kv_counts, torch.int32),
        kv_indices=torch.cat(kv_parts) if kv_parts else torch.empty(0, dtype=torch.int64),
        custom_mask=torch.cat(mask_parts).to(torch.uint8),
        mask_indptr=indptr(mask_counts, torch.int64),
        max_extend_len=max(lens),
    )
