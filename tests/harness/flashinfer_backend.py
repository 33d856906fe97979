"""sglang 0.5.23's real `FlashInferAttnBackend` and `TRTLLMHAAttnBackend` on CPU, for an EXTEND
forward of a random batch (tests/sparse_extend_batches.py), with torch stand-ins for the CUDA
kernels they call.

The backends are built without a model runner (their ``__init__`` needs CUDA and a runtime
context): `flashinfer` and `trtllm` set exactly the attributes `init_forward_metadata`'s extend
branch and `forward_extend` read, with SGLang's values for a plain MHA model, SGLang's own
`MHATokenToKVPool` (at the page size under test), `KVIndexTranslator` and, for flashinfer, its
real `FlashInferIndicesUpdaterPrefill`. Their metadata code runs Triton kernels
(`create_flashinfer_kv_indices_triton`, `build_trtllm_mha_page_table`): callers run under
TRITON_INTERPRET=1.

Stand-ins (torch, float64 inside, each implementing the documented contract of the kernel it
replaces; every test that uses one says so in its name):

- `PagedPrefill`: flashinfer ``BatchPrefillWithPagedKVCacheWrapper`` ``plan``/``begin_forward``,
  ``forward``, ``forward_return_lse``: paged KV through ``paged_kv_indptr``/``paged_kv_indices``/
  ``paged_kv_last_page_len`` at ``page_size``, queries through ``qo_indptr``, causal mask
  bottom-right aligned (query ``i`` of a request sees key ``j <= i + kv_len - qo_len``), LSE in
  base 2.
- `RaggedPrefill`: ``BatchPrefillWithRaggedKVCacheWrapper`` (``begin_forward(qo_indptr,
  kv_indptr, ...)``, ``forward``, ``forward_return_lse``) over packed k/v.
- `merge_state`: ``flashinfer.cascade.merge_state`` (two partial outputs with base-2 LSEs).
- `trtllm_context`: ``flashinfer.prefill.trtllm_batch_context_with_kv_cache`` (HND paged KV
  ``[pages, kv_heads, page_size, dim]``, ``block_tables [batch, pages]``, ``seq_lens`` = KV lengths,
  ``cum_seq_lens_q``/``cum_seq_lens_kv``, bottom-right causal, ``bmm1_scale``/``bmm2_scale``).
- `trtllm_decode`: ``flashinfer.decode.trtllm_batch_decode_with_kv_cache`` (``q_len_per_req``
  queries per request at the end of its ``seq_lens`` keys).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

from tests.harness import triton_backend
from tests.harness.attention_backend import forward_batch
from tests.sparse_extend_batches import Batch


# ------------------------------------------------------------------------------ stand-ins
def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q [Lq, Hq, D], k/v [Lk, Hkv, D]; bottom-right causal. (out float64
    [Lq, Hq, D], base-2 LSE float64 [Lq, Hq])."""
    lq, hq, _ = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads over {hkv} kv heads")
    rep = hq // hkv
    kk = k.double().repeat_interleave(rep, dim=1)
    vv = v.double().repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if causal:
        qi = torch.arange(lq)[:, None]
        kj = torch.arange(lk)[None, :]
        s = s.masked_fill(~(kj <= qi + (lk - lq)), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Lq], natural log
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("hqk,khd->qhd", p, vv) * v_scale
    return o, (lse / math.log(2.0)).transpose(0, 1)


def _unsupported(**options: Any) -> None:
    for name, value in options.items():
        if value not in (None, -1, 0, 0.0, False, 1.0, "NONE"):
            raise NotImplementedError(f"stand-in: {name}={value!r} is not implemented")


def _expand_nhd(cache: torch.Tensor) -> torch.Tensor:
    """flashinfer's ``_expand_4d`` for NHD: a 3-D cache [slots, H, D] is page size 1."""
    return cache.unsqueeze(1) if cache.dim() == 3 else cache


class PagedPrefill:
    """Stand-in for flashinfer's ``BatchPrefillWithPagedKVCacheWrapper`` (NHD layout)."""

    def __init__(self) -> None:
        self.plans: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        prefix_len_ptr: torch.Tensor | None = None,
        **kw: Any,
    ) -> None:
        """Keep the plan (references, as flashinfer keeps device tensors)."""
        _unsupported(
            custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            prefix_len_ptr=prefix_len_ptr,
        )
        n = qo_indptr.numel() - 1
        if paged_kv_indptr.numel() != n + 1 or paged_kv_last_page_len.numel() != n:
            raise ValueError("plan: indptr/last_page_len lengths disagree with qo_indptr")
        self.plans.append(
            {
                "qo_indptr": qo_indptr,
                "kv_indptr": paged_kv_indptr,
                "kv_indices": paged_kv_indices,
                "last_page_len": paged_kv_last_page_len,
                "heads": (num_qo_heads, num_kv_heads, head_dim_qk),
                "page_size": page_size,
                "causal": causal,
            }
        )

    begin_forward = plan

    def _run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        causal: bool,
        sm_scale: float | None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _unsupported(window_left=window_left, logits_soft_cap=logits_soft_cap)
        plan = self.plans[-1]
        hq, hkv, d = plan["heads"]
        if q.shape[1] != hq or q.shape[2] != d:
            raise ValueError(f"run: q {tuple(q.shape)} against a plan for {hq} heads of {d}")
        k_cache, v_cache = (_expand_nhd(c) for c in paged_kv_cache)
        if k_cache.shape[1] != plan["page_size"] or k_cache.shape[2] != hkv:
            raise ValueError(f"run: cache {tuple(k_cache.shape)} against the plan")
        qo = plan["qo_indptr"].tolist()
        kv = plan["kv_indptr"].tolist()
        indices = plan["kv_indices"].long()
        last = plan["last_page_len"].tolist()
        page = plan["page_size"]
        scale = sm_scale if sm_scale is not None else d**-0.5
        scale *= 1.0 if k_scale is None else k_scale
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        for i in range(len(qo) - 1):
            pages = indices[kv[i] : kv[i + 1]]
            kv_len = 0 if pages.numel() == 0 else page * (pages.numel() - 1) + last[i]
            keys = k_cache[pages].reshape(-1, hkv, k_cache.shape[-1])[:kv_len]
            vals = v_cache[pages].reshape(-1, hkv, v_cache.shape[-1])[:kv_len]
            if qo[i + 1] == qo[i] or kv_len == 0:
                continue
            o, s = _attend(
                q[qo[i] : qo[i + 1]],
                keys,
                vals,
                causal=causal,
                scale=scale,
                v_scale=1.0 if v_scale is None else v_scale,
            )
            out[qo[i] : qo[i + 1]] = o
            lse[qo[i] : qo[i + 1]] = s
        self.runs.append({"causal": causal, "tokens": q.shape[0]})
        return out.to(q.dtype), lse.float()

    def forward(
        self, q: torch.Tensor, paged_kv_cache: Any, causal: bool = False, **kw: Any
    ) -> torch.Tensor:
        """Attention output [tokens, Hq, D] in q's dtype."""
        return self._run(q, paged_kv_cache, causal, **_run_kw(kw))[0]

    def forward_return_lse(
        self, q: torch.Tensor, paged_kv_cache: Any, causal: bool = False, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, base-2 LSE [tokens, Hq])."""
        return self._run(q, paged_kv_cache, causal, **_run_kw(kw))


def _run_kw(kw: dict[str, Any]) -> dict[str, Any]:
    keep = ("sm_scale", "k_scale", "v_scale", "window_left", "logits_soft_cap")
    _unsupported(**{k: v for k, v in kw.items() if k not in keep})
    return {"sm_scale": kw.get("sm_scale"), **{k: kw[k] for k in keep[1:] if k in kw}}


class RaggedPrefill:
    """Stand-in for flashinfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (NHD layout)."""

    def __init__(self) -> None:
        self.plans: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.runs = 0

    def begin_forward(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        **kw: Any,
    ) -> None:
        """Keep the query and key indptrs."""
        self.plans.append((qo_indptr, kv_indptr))

    plan = begin_forward

    def forward_return_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, base-2 LSE) of each request's queries over its own packed keys."""
        run_kw = _run_kw(kw)
        _unsupported(
            window_left=run_kw.get("window_left", -1),
            logits_soft_cap=run_kw.get("logits_soft_cap"),
        )
        qo, kv = (t.tolist() for t in self.plans[-1])
        scale = run_kw["sm_scale"] if run_kw["sm_scale"] is not None else q.shape[-1] ** -0.5
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        for i in range(len(qo) - 1):
            if qo[i + 1] == qo[i] or kv[i + 1] == kv[i]:
                continue
            o, s = _attend(
                q[qo[i] : qo[i + 1]],
                k[kv[i] : kv[i + 1]],
                v[kv[i] : kv[i + 1]],
                causal=causal,
                scale=scale,
            )
            out[qo[i] : qo[i + 1]] = o
            lse[qo[i] : qo[i + 1]] = s
        self.runs += 1
        return out.to(q.dtype), lse.float()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, **kw: Any
    ) -> torch.Tensor:
        """Attention output [tokens, Hq, D]."""
        return self.forward_return_lse(q, k, v, causal, **kw)[0]


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for ``flashinfer.cascade.merge_state``: the attention over the union of two key
    sets from each set's output and base-2 LSE."""
    m = torch.maximum(s_a, s_b).double()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa = torch.exp2(s_a.double() - m)
    wb = torch.exp2(s_b.double() - m)
    total = wa + wb
    o = (v_a.double() * wa[..., None] + v_b.double() * wb[..., None]) / total[..., None]
    return o.to(v_a.dtype), (m + torch.log2(total)).float()


def _trtllm_attend(
    query: torch.Tensor,
    kv_cache: Any,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cum_q: list[int],
    bmm1_scale: float,
    bmm2_scale: float,
    causal: bool,
    out: torch.Tensor | None,
    out_dtype: Any,
) -> torch.Tensor:
    k_cache, v_cache = kv_cache  # HND: [pages, kv_heads, page_size, dim]
    page, hkv = k_cache.shape[2], k_cache.shape[1]
    lens = seq_lens.tolist()
    result = torch.zeros(query.shape, dtype=torch.float64)
    for i, kv_len in enumerate(lens):
        n_pages = -(-kv_len // page)
        pages = block_tables[i, :n_pages].long()
        keys = k_cache[pages].permute(0, 2, 1, 3).reshape(-1, hkv, k_cache.shape[-1])[:kv_len]
        vals = v_cache[pages].permute(0, 2, 1, 3).reshape(-1, hkv, v_cache.shape[-1])[:kv_len]
        if cum_q[i + 1] == cum_q[i]:
            continue
        o, _ = _attend(
            query[cum_q[i] : cum_q[i + 1]],
            keys,
            vals,
            causal=causal,
            scale=float(bmm1_scale),
            v_scale=float(bmm2_scale),
        )
        result[cum_q[i] : cum_q[i + 1]] = o
    dtype = out.dtype if out is not None else (out_dtype or query.dtype)
    if out is None:
        return result.to(dtype)
    out.copy_(result.to(out.dtype))
    return out


def trtllm_context(
    query: torch.Tensor,
    kv_cache: Any,
    workspace_buffer: Any,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    bmm1_scale: float,
    bmm2_scale: float,
    batch_size: int,
    cum_seq_lens_q: torch.Tensor,
    cum_seq_lens_kv: torch.Tensor,
    window_left: int = -1,
    out: torch.Tensor | None = None,
    out_dtype: Any = None,
    kv_layout: str = "HND",
    sinks: Any = None,
    kv_cache_sf: Any = None,
    skip_softmax_threshold_scale_factor: float | None = None,
    causal: bool = True,
    **kw: Any,
) -> torch.Tensor:
    """Stand-in for ``flashinfer.prefill.trtllm_batch_context_with_kv_cache``."""
    _unsupported(
        window_left=window_left,
        sinks=sinks,
        kv_cache_sf=kv_cache_sf,
        skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
    )
    if kv_layout != "HND":
        raise NotImplementedError("stand-in: HND only")
    cum_q = cum_seq_lens_q.tolist()
    cum_kv = cum_seq_lens_kv.tolist()
    lens = seq_lens.tolist()
    if not (batch_size == len(lens) == len(cum_q) - 1 == len(cum_kv) - 1):
        raise ValueError("trtllm context: batch_size, seq_lens and cum_seq_lens disagree")
    if any(cum_kv[i + 1] - cum_kv[i] != n for i, n in enumerate(lens)):
        raise ValueError("trtllm context: cum_seq_lens_kv is not the prefix sum of seq_lens")
    q_lens = [cum_q[i + 1] - cum_q[i] for i in range(batch_size)]
    if max(q_lens, default=0) > max_q_len or max(lens, default=0) > max_kv_len:
        raise ValueError("trtllm context: a length exceeds max_q_len / max_kv_len")
    if any(ql > n for ql, n in zip(q_lens, lens, strict=True)):
        raise ValueError("trtllm context: more queries than keys")
    return _trtllm_attend(
        query, kv_cache, block_tables, seq_lens, cum_q, bmm1_scale, bmm2_scale, causal, out,
        out_dtype,
    )  # fmt: skip


def trtllm_decode(
    query: torch.Tensor,
    kv_cache: Any,
    workspace_buffer: Any,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    window_left: int = -1,
    out: torch.Tensor | None = None,
    out_dtype: Any = None,
    sinks: Any = None,
    kv_cache_sf: Any = None,
    skip_softmax_threshold_scale_factor: float | None = None,
    q_len_per_req: int | None = 1,
    mask: Any = None,
    **kw: Any,
) -> torch.Tensor:
    """Stand-in for ``flashinfer.decode.trtllm_batch_decode_with_kv_cache`` (fixed
    ``q_len_per_req`` queries per request, the last ones of its ``seq_lens`` keys)."""
    _unsupported(
        window_left=window_left,
        sinks=sinks,
        kv_cache_sf=kv_cache_sf,
        skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
        mask=mask,
    )
    per = q_len_per_req or 1
    cum_q = [i * per for i in range(seq_lens.numel() + 1)]
    if cum_q[-1] != query.shape[0]:
        raise ValueError("trtllm decode: query rows != requests x q_len_per_req")
    return _trtllm_attend(
        query, kv_cache, block_tables, seq_lens, cum_q, bmm1_scale, bmm2_scale, True, out,
        out_dtype,
    )  # fmt: skip


def trtllm_kernels() -> SimpleNamespace:
    """What ``trtllm_mha_backend`` calls as ``flashinfer.prefill``/``flashinfer.decode``."""
    return SimpleNamespace(
        prefill=SimpleNamespace(trtllm_batch_context_with_kv_cache=trtllm_context),
        decode=SimpleNamespace(trtllm_batch_decode_with_kv_cache=trtllm_decode),
    )


# ------------------------------------------------------------------------------ batches
def paged(batch: Batch, page_size: int, seed: int = 0) -> Batch:
    """The batch with its rows laid out in whole pages of ``page_size`` (a request's position
    ``p`` in slot ``page * page_size + p % page_size`` of a page of its own, pages in random
    order, page 0 left as SGLang's padding page); the same KV at the same positions."""
    if page_size == 1:
        return batch
    g = torch.Generator().manual_seed(seed)
    r2t = torch.zeros_like(batch.req_to_token)
    lens = batch.seq_lens.tolist()
    rows = batch.req_pool_indices.tolist()
    n_pages = sum(-(-n // page_size) for n in lens)
    order = (torch.randperm(n_pages, generator=g) + 1).tolist()
    slots = (n_pages + 1) * page_size
    hkv, d = batch.k_cache.shape[1:]
    k_cache = torch.randn(slots, hkv, d, generator=g, dtype=batch.k_cache.dtype)
    v_cache = torch.randn(slots, hkv, d, generator=g, dtype=batch.v_cache.dtype)
    for row, n in zip(rows, lens, strict=True):
        pos = torch.arange(n)
        pages = torch.tensor([order.pop() for _ in range(-(-n // page_size))])
        new = pages[pos // page_size] * page_size + pos % page_size
        old = batch.req_to_token[row, :n].long()
        r2t[row, :n] = new.to(r2t.dtype)
        k_cache[new] = batch.k_cache[old]
        v_cache[new] = batch.v_cache[old]
    starts = torch.cumsum(batch.extend_seq_lens, 0) - batch.extend_seq_lens
    loc = []
    for i, (row, c) in enumerate(zip(rows, batch.extend_seq_lens.tolist(), strict=True)):
        pos = batch.positions[int(starts[i]) : int(starts[i]) + c]
        loc.append(r2t[row, pos].long())
    return Batch(
        q=batch.q,
        k=batch.k,
        v=batch.v,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=r2t,
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        extend_prefix_lens=batch.extend_prefix_lens,
        extend_seq_lens=batch.extend_seq_lens,
        positions=batch.positions,
        out_cache_loc=torch.cat(loc),
        kinds=batch.kinds,
    )


def pool(batch: Batch, page_size: int, seed: int = 1) -> Any:
    """SGLang's real one-layer `MHATokenToKVPool` at ``page_size`` holding the batch's cache,
    except the slots this pass computes, which hold stale KV (another generator's values):
    whatever reads them before the pass writes them is wrong."""
    from tests.harness.attention_backend import real_pool

    out = real_pool(batch, page_size)
    _, hkv, d = batch.k_cache.shape
    g = torch.Generator().manual_seed(seed)
    loc = batch.out_cache_loc
    shape = (loc.numel(), hkv, d)
    out.k_buffer[0][loc] = torch.randn(shape, generator=g).to(batch.k_cache.dtype)
    out.v_buffer[0][loc] = torch.randn(shape, generator=g).to(batch.v_cache.dtype)
    return out


def layer(batch: Batch, **kw: Any) -> SimpleNamespace:
    """The RadixAttention fields the flashinfer and trtllm extends read: the triton harness's
    layer plus head_dim, tp_v_head_num and the float KV scales (`kw` overrides)."""
    d = batch.q.shape[2]
    extra = {
        "head_dim": d,
        "tp_v_head_num": batch.k.shape[1],
        "k_scale_float": None,
        "v_scale_float": None,
    }
    return triton_backend.layer(batch, **{**extra, **kw})


def _translator(batch: Batch, kv_pool: Any, page_size: int) -> Any:
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    return KVIndexTranslator(
        req_to_token=batch.req_to_token,
        token_to_kv_pool_allocator=None,
        token_to_kv_pool=kv_pool,
        page_size=page_size,
        device="cpu",
    )


def flashinfer(batch: Batch, page_size: int = 1, max_bs: int = 8) -> Any:
    """A `FlashInferAttnBackend` over the batch's rows and a real pool, its wrappers stand-ins
    (`PagedPrefill`, `RaggedPrefill`), its prefill indices updater SGLang's, its per-sequence
    buffers sized by ``max_bs`` as SGLang sizes them by the request pool."""
    from sglang.srt.layers.attention.flashinfer_backend import (
        FlashInferAttnBackend,
        FlashInferIndicesUpdaterPrefill,
    )
    from sglang.srt.runtime_context import get_parallel

    kv_pool = pool(batch, page_size)
    hq, hkv, d = batch.q.shape[1], batch.k.shape[1], batch.q.shape[2]
    out = object.__new__(FlashInferAttnBackend)
    fields: dict[str, Any] = {
        "prefill_backend": "fa2",
        "req_to_token_pool": SimpleNamespace(req_to_token=batch.req_to_token, size=max_bs),
        "token_to_kv_pool": kv_pool,
        "kv_index_translator": _translator(batch, kv_pool, page_size),
        "_swa_kv_pool": None,
        "use_sliding_window_kv_pool": False,
        "enable_mis": False,
        "is_dllm_model": False,
        "dllm_config": None,
        "kv_cache_quant_method": kv_pool.get_kv_cache_quant_method(),
        "prefill_uses_dequant_workspace": False,
        "decode_uses_dequant_workspace": False,
        "dq_page_table": None,
        "dq_paged_kernel_lens": None,
        "cpu_req_pool_indices": None,
        "flashinfer_kv_cache_dtype": batch.k_cache.dtype,
        "max_context_len": batch.req_to_token.shape[1],
        "page_size": page_size,
        "skip_prefill": False,
        "is_multimodal": False,
        "num_wrappers": 1,
        "dispatch_reason": None,
        "enable_deterministic": False,
        "prefill_split_tile_size": None,
        "use_paged": False,
        "kv_indptr": [torch.zeros(max_bs + 1, dtype=torch.int32)],
        "kv_last_page_len": torch.ones(max_bs, dtype=torch.int32),
        "qo_indptr": [torch.zeros(max_bs + 1, dtype=torch.int32)],
        "prefill_wrapper_ragged": RaggedPrefill(),
        "prefill_wrappers_paged": [PagedPrefill()],
        "forward_metadata": None,
    }
    for name, value in fields.items():
        setattr(out, name, value)
    runner = SimpleNamespace(
        model_config=SimpleNamespace(
            get_max_num_attention_heads=lambda: hq,
            get_num_kv_heads=lambda tp, dcp=1: hkv,
            head_dim=d,
        ),
        dtype=batch.q.dtype,
        sliding_window_size=None,
    )
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        out.indices_updater_prefill = FlashInferIndicesUpdaterPrefill(runner, out)
    return out


def trtllm(batch: Batch, page_size: int = 64) -> Any:
    """A `TRTLLMHAAttnBackend` (SM100's batch-context prefill) over the batch's rows and a real
    pool at ``page_size``."""
    from sglang.srt.layers.attention.trtllm_mha_backend import TRTLLMHAAttnBackend

    kv_pool = pool(batch, page_size)
    out = object.__new__(TRTLLMHAAttnBackend)
    max_context = batch.req_to_token.shape[1]
    fields: dict[str, Any] = {
        "req_to_token": batch.req_to_token,
        "req_to_token_pool": SimpleNamespace(req_to_token=batch.req_to_token),
        "token_to_kv_pool": kv_pool,
        "kv_index_translator": _translator(batch, kv_pool, page_size),
        "kv_cache_quant_method": kv_pool.get_kv_cache_quant_method(),
        "_swa_kv_pool": None,
        "use_sliding_window_kv_pool": False,
        "skip_prefill": False,
        "use_fmha_v2": False,
        "is_xqa_impl": False,
        "uses_trtllm_gen_native_fp4": False,
        "prefill_uses_native_fp4": False,
        "decode_uses_native_fp4": False,
        "is_nvfp4_kvcache": False,
        "expand_encoder_only_verify": False,
        "data_type": batch.k_cache.dtype,
        "q_data_type": batch.q.dtype,
        "page_size": page_size,
        "max_context_len": max_context,
        "max_num_pages": -(-max_context // page_size),
        "device": "cpu",
        "workspace_buffer": None,
        "decode_seq_len_splits": 1,
        "_multi_ctas_kv_counter_buffer": None,
        "forward_metadata": None,
    }
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def extend_batch(batch: Batch, **kw: Any) -> Any:
    """The batch as sglang's real EXTEND ForwardBatch with its own KV-location plan."""
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    fb = forward_batch(batch, **kw)
    translator = KVIndexTranslator(
        req_to_token=batch.req_to_token,
        token_to_kv_pool_allocator=None,
        token_to_kv_pool=None,
        page_size=1,
        device="cpu",
    )
    fb.kv_loc_plan = translator.own_plan(fb)
    return fb


def forward(backend: Any, batch: Batch, *, fb: Any = None, **layer_kw: Any) -> torch.Tensor:
    """`init_forward_metadata` then `forward_extend` of the batch's queries ([T, Hq, D])."""
    fb = fb if fb is not None else extend_batch(batch)
    backend.init_forward_metadata(fb)
    q = batch.q.reshape(batch.q.shape[0], -1)
    out = backend.forward_extend(q, batch.k, batch.v, layer(batch, **layer_kw), fb)
    return out.view_as(batch.q)
