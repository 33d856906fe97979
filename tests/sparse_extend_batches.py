"""Random EXTEND batches under the sparse-extend contract, shared by the sparse-extend tests.

Each request is cold (computed [0, n)), an exact hit (computed [m, n)), sparse (exact prefix m,
then a random subset of [m, n) that holds n - 1 and misses at least one position: many short
runs), a sparse non-final chunk (the same without n - 1) or, when asked for, ``sparse_runs``
(three long runs after m, the last ending at n: what a plan of a few reused spans computes).
Rows are random distinct pool slots (whole random pages at a page size > 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from semblend_sglang.kernels.sparse_extend import ExtendRows

KINDS = ("cold", "exact", "sparse", "sparse_chunk")


@dataclass
class Batch:
    """One EXTEND batch: the pool, the rows and the per-request fields SGLang's ForwardBatch has."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] (the computed tokens' own K, also written into k_cache)
    v: torch.Tensor
    k_cache: torch.Tensor  # [S, Hkv, D]
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # int32 [R, max_len]
    req_pool_indices: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int64 [B]
    extend_prefix_lens: torch.Tensor  # int64 [B], m (exact prefix)
    extend_seq_lens: torch.Tensor  # int64 [B], computed count
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]
    kinds: list[str]

    def rows(self, **change: torch.Tensor | None) -> ExtendRows:
        """The batch's :class:`ExtendRows`, with the fields named in ``change`` replaced."""
        rows = ExtendRows(
            self.req_to_token,
            self.req_pool_indices,
            self.seq_lens,
            self.extend_seq_lens,
            self.positions,
        )
        return dataclasses.replace(rows, **change)


def _positions(kind: str, n: int, g: torch.Generator) -> tuple[int, torch.Tensor]:
    if kind == "cold":
        return 0, torch.arange(n)
    m = int(torch.randint(1, n, (1,), generator=g))
    if kind == "exact":
        return m, torch.arange(m, n)
    if kind == "sparse_runs":  # runs [m, m+w), [m+2w, m+3w), [n-w, n) around two reused gaps
        w = max(1, (n - m) // 5)
        pos = torch.cat([torch.arange(m, m + w), torch.arange(m + 2 * w, m + 3 * w)])
        pos = torch.unique(torch.cat([pos, torch.arange(n - w, n)]))
        return m, pos[pos < n]  # a short request: the runs overlap or end early
    rest = torch.arange(m, n - 1)
    keep = rest[torch.rand(rest.numel(), generator=g) < 0.4]
    if kind == "sparse":
        pos = torch.cat([keep, torch.tensor([n - 1])])
        if pos.numel() == n - m > 1:  # every position computed: not sparse, drop one
            pos = pos[1:]
        return m, pos
    return m, keep if keep.numel() else torch.tensor([m])


def random_batch(
    seed: int,
    *,
    n_requests: int = 4,
    max_len: int = 48,
    min_len: int = 3,
    heads: tuple[int, int] = (6, 2),
    head_dim: int = 16,
    kinds: tuple[str, ...] = KINDS,
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
) -> Batch:
    """A batch of ``n_requests`` requests of random kinds (at least one of each kind given, when
    there is room) and lengths in [min_len, max_len], the computed K/V already in the pool.

    With ``page_size`` > 1 each row holds whole random pages (slot = page * page_size + offset,
    its pages owned by that row alone), as SGLang's paged allocator lays rows out."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    chosen = list(kinds[:n_requests]) + [
        kinds[int(torch.randint(len(kinds), (1,), generator=g))]
        for _ in range(n_requests - len(kinds))
    ]
    lens = [int(torch.randint(min_len, max_len + 1, (1,), generator=g)) for _ in chosen]
    pages = [-(-n // page_size) for n in lens]
    pool = (sum(pages) + 2) * page_size if page_size > 1 else sum(lens) + 16
    rows_total = n_requests + 2
    page_order = torch.randperm(pool // page_size, generator=g)
    slots = (page_order[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    req_to_token = torch.zeros(rows_total, max_len, dtype=torch.int32)
    row_ids = torch.randperm(rows_total, generator=g)[:n_requests]
    k_cache = torch.randn(pool, hkv, head_dim, generator=g, dtype=dtype)
    v_cache = torch.randn(pool, hkv, head_dim, generator=g, dtype=dtype)
    prefix, counts, positions, out_loc = [], [], [], []
    used = 0
    for row, n, kind, npages in zip(row_ids.tolist(), lens, chosen, pages, strict=True):
        req_to_token[row, :n] = slots[used : used + n].to(torch.int32)
        used += npages * page_size
        m, pos = _positions(kind, n, g)
        prefix.append(m)
        counts.append(pos.numel())
        positions.append(pos)
        out_loc.append(req_to_token[row, pos].to(torch.int64))
    pos_all = torch.cat(positions).to(torch.int64)
    loc = torch.cat(out_loc)
    t = pos_all.numel()
    q = torch.randn(t, hq, head_dim, generator=g, dtype=dtype)
    k = torch.randn(t, hkv, head_dim, generator=g, dtype=dtype)
    v = torch.randn(t, hkv, head_dim, generator=g, dtype=dtype)
    k_cache[loc] = k
    v_cache[loc] = v
    return Batch(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=req_to_token,
        req_pool_indices=row_ids.to(torch.int64),
        seq_lens=torch.tensor(lens, dtype=torch.int64),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int64),
        extend_seq_lens=torch.tensor(counts, dtype=torch.int64),
        positions=pos_all,
        out_cache_loc=loc,
        kinds=chosen,
    )
