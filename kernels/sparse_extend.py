"""Extend attention for a sparse extend: the queries of a request are any subset of its positions.

Engine-agnostic torch (no sglang import). The inputs are shaped like SGLang's
``TorchNativeAttnBackend._run_sdpa_forward_extend`` so an attention backend hook is a thin wrapper.

Contract of a batch (one EXTEND forward pass of ``B`` requests, ``T`` computed tokens in all):

- ``req_to_token[req_pool_indices[i], 0:seq_lens[i]]`` holds a KV slot for every position
  ``0..n_i-1`` of request ``i``, in position order. The K/V of every position a query may see is
  already in ``k_cache``/``v_cache`` (reused positions before the pass; computed ones written by
  the backend before attention, as SGLang does).
- Request ``i``'s computed tokens are ``q[s_i : s_i + extend_seq_lens[i]]`` with
  ``s_i = extend_start_loc[i]`` (default: the running sum of ``extend_seq_lens``); their
  positions ``positions[s_i : s_i + extend_seq_lens[i]]`` are distinct, ascending and ``< n_i``.
- A query at position ``p`` attends to every key at position ``<= p`` of its own row (reused or
  computed in this pass): a position mask, not index causality. With ``causal=False`` it attends
  to every key ``[0, n_i)``.

An ordinary request is the special case positions = ``[m_i, n_i)`` (cold: ``m_i = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch.nn.functional import scaled_dot_product_attention

DENSE_FRACTION = 0.5
"""A request with ``computed >= DENSE_FRACTION * n`` runs SDPA with ``is_causal=True`` over a query
tensor of the whole row (SGLang's own form): on CPU a boolean mask costs about twice the causal
kernel per query row (docs/kernels.md), so past about half the row the masked form is slower."""


@dataclass(frozen=True)
class ExtendRows:
    """Where one EXTEND batch's keys are and which positions it computes: the module contract's
    fields (``extend_start_loc`` None = the running sum of ``extend_seq_lens``).

    Built by the attention hooks from SGLang's ForwardBatch and by tests; the kernels here and in
    :mod:`.sparse_extend_triton` only read it.
    """

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    positions: torch.Tensor
    extend_start_loc: torch.Tensor | None = None

    def lens(self) -> list[int]:
        """Computed tokens per request."""
        return [int(x) for x in self.extend_seq_lens.tolist()]

    def row_lens(self) -> list[int]:
        """Keys per request: its whole row, ``seq_lens``."""
        return [int(x) for x in self.seq_lens.tolist()]

    def pool_rows(self) -> list[int]:
        """Each request's row of ``req_to_token``."""
        return [int(x) for x in self.req_pool_indices.tolist()]

    def packed_starts(self) -> list[int]:
        """The running sum of :meth:`lens`, the total appended: where each request's computed
        tokens start when they are packed request after request, as SGLang lays them out."""
        return list(accumulate(self.lens(), initial=0))

    def starts(self) -> list[int]:
        """Offset of each request's first computed token in ``q`` and ``positions``."""
        if self.extend_start_loc is not None:
            return [int(x) for x in self.extend_start_loc.tolist()]
        return self.packed_starts()[:-1]

    def check_shapes(self, n_queries: int) -> None:
        """ValueError when the per-request fields differ in batch size or ``positions`` does
        not hold one entry per query."""
        b = self.seq_lens.shape[0]
        if self.extend_seq_lens.shape[0] != b or self.req_pool_indices.shape[0] != b:
            raise ValueError("seq_lens, extend_seq_lens and req_pool_indices differ in batch size")
        n_positions = self.positions.shape[0]
        if n_positions != n_queries:
            raise ValueError(f"positions has {n_positions} entries for {n_queries} queries")


def extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: ExtendRows,
    *,
    scaling: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Dense oracle: softmax(q K^T * scaling + mask) V over each request's whole row, in float64.

    Shapes: ``q`` [T, Hq, D]; ``k_cache`` [S, Hkv, D]; ``v_cache`` [S, Hkv, Dv]; ``Hq`` a
    multiple of ``Hkv`` (query head ``h`` reads KV head ``h // (Hq // Hkv)``). The mask is built
    explicitly: key position ``j`` is visible to the query at position ``p`` iff ``j <= p`` (all
    ``j < n`` with ``causal=False``). Returns [T, Hq, Dv] in ``q.dtype``; validates the positions
    (raises ValueError when one is outside ``[0, n_i)``, repeated or out of order).
    """
    rows.check_shapes(q.shape[0])
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.zeros(q.shape[0], hq, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lens = rows.lens()
    for i, start in enumerate(rows.starts()):
        c, n = lens[i], int(rows.seq_lens[i])
        if c == 0:
            continue
        pos = rows.positions[start : start + c].to(torch.int64)
        if int(pos.min()) < 0 or int(pos.max()) >= n or bool((pos[1:] <= pos[:-1]).any()):
            raise ValueError(f"request {i}: positions must be distinct, ascending and < {n}")
        slots = rows.req_to_token[int(rows.req_pool_indices[i]), :n].to(torch.int64)
        k = k_cache[slots].to(torch.float64).repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[slots].to(torch.float64).repeat_interleave(hq // hkv, dim=1)
        qi = q[start : start + c].to(torch.float64)  # [c, Hq, D]
        scores = torch.einsum("chd,nhd->hcn", qi, k) * scale
        key_pos = torch.arange(n, device=q.device)
        visible = key_pos[None, :] <= pos[:, None] if causal else torch.ones(c, n, dtype=torch.bool)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + c] = torch.einsum("hcn,nhd->chd", probs, v).to(q.dtype)
    return out


def extend_attention_query_only(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    output: torch.Tensor,
    rows: ExtendRows,
    *,
    scaling: float | None = None,
    enable_gqa: bool = False,
    causal: bool = True,
    dense_fraction: float = DENSE_FRACTION,
) -> torch.Tensor:
    """Write each computed query's attention output into ``output`` [T, Hq, Dv]; return it.

    Same shapes and semantics as :func:`extend_attention_reference` (``enable_gqa`` as for torch
    SDPA: required when ``Hq != Hkv``), computed with torch SDPA in ``q.dtype`` (K/V are cast to
    it, as SGLang does). Per request, with
    ``c`` computed queries over ``n`` keys:

    - ``c < dense_fraction * n``: only the ``c`` queries against keys ``[0, n)`` with a boolean
      position mask (cost ~ c x n; no mask when ``causal=False``);
    - otherwise (a cold request is ``c == n``): the queries are scattered to their positions in a
      query tensor of the whole row and SDPA runs with ``is_causal=causal`` (SGLang's shipped
      form, cost ~ n^2 / 2): for an ordinary request this is SGLang's computation exactly.

    Positions are trusted (see the module contract); they are not validated here.
    """
    rows.check_shapes(q.shape[0])
    lens = rows.lens()
    n_list = rows.row_lens()
    pool_rows = rows.pool_rows()
    q_hnd = q.movedim(0, 1)  # [Hq, T, D] view
    for i, start in enumerate(rows.starts()):
        c, n = lens[i], n_list[i]
        if c == 0:
            continue
        end = start + c
        slots = rows.req_to_token[pool_rows[i], :n]
        k = k_cache[slots].movedim(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, n, D]
        v = v_cache[slots].movedim(0, 1).unsqueeze(0).to(q.dtype)
        pos = rows.positions[start:end]
        if c >= dense_fraction * n:
            if c == n:
                qi = q_hnd[:, start:end]
            else:
                qi = q.new_zeros(q.shape[1], n, q.shape[2])
                qi[:, pos] = q_hnd[:, start:end]
            o = scaled_dot_product_attention(
                qi.unsqueeze(0), k, v, scale=scaling, is_causal=causal, enable_gqa=enable_gqa
            ).squeeze(0)  # [Hq, n, Dv]
            output[start:end] = (o if c == n else o[:, pos]).movedim(0, 1)
            continue
        mask = None
        if causal:
            mask = torch.arange(n, device=pos.device)[None, :] <= pos[:, None]  # [c, n]
        o = scaled_dot_product_attention(
            q_hnd[:, start:end].unsqueeze(0),
            k,
            v,
            attn_mask=mask,
            scale=scaling,
            enable_gqa=enable_gqa,
        ).squeeze(0)  # [Hq, c, Dv]
        output[start:end] = o.movedim(0, 1)
    return output
