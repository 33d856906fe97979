"""sglang 0.5.23's real `FlashAttentionBackend` (fa3) on CPU, for an EXTEND forward of a random
batch (tests/sparse_extend_batches.py), with a torch stand-in for its CUDA kernel.

`module` imports sglang's flashattention_backend here: its one import-time need from sgl_kernel
(`merge_state_v2`, used only by speculative cascade attention) is an import-only stand-in that
raises when called. `flash_attn_with_kvcache_standin` implements the documented contract of
sgl_kernel's FA3 `flash_attn_with_kvcache` for a paged prefill (docstring of
sglang.kernels.ops.attention.flash_attention): varlen queries by `cu_seqlens_q`, the paged cache
read through `page_table` up to `cache_seqlens`, GQA, and the causal mask aligned to the
bottom-right of each sequence's key range. `backend` builds the class without a model runner,
setting exactly the attributes `init_forward_metadata`'s extend branch and `forward_extend`'s MHA
path read, with SGLang's values for a plain MHA model, and SGLang's own `MHATokenToKVPool` and
`KVIndexTranslator` at the page size asked for.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import torch

from tests.harness import attention_backend
from tests.sparse_extend_batches import Batch


def _merge_state_v2_standin(*_args: Any, **_kw: Any) -> Any:
    raise RuntimeError("merge_state_v2 is an import-only stand-in in this test (no CUDA kernel)")


def module() -> types.ModuleType:
    """sglang's ``flashattention_backend`` module, imported with ``sgl_kernel.merge_state_v2``
    provided by an import-only stand-in when the installed ``sgl_kernel`` lacks it."""
    name = "sglang.srt.layers.attention.flashattention_backend"
    if name in sys.modules:
        return sys.modules[name]
    try:
        import sgl_kernel  # the CPU runtime's import-only stand-in, when on the path
    except ImportError:
        sgl_kernel = types.ModuleType("sgl_kernel")
        sys.modules["sgl_kernel"] = sgl_kernel
    if not hasattr(sgl_kernel, "merge_state_v2"):
        sgl_kernel.merge_state_v2 = _merge_state_v2_standin  # type: ignore[attr-defined]
    import importlib

    return importlib.import_module(name)


def flash_attn_with_kvcache_standin(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_softmax_lse: bool = False,
    out: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    **_unused: Any,
) -> torch.Tensor:
    """FA3's paged ``flash_attn_with_kvcache`` contract in torch (float64 inside).

    q [total_q, Hq, D] (sequence b's queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``);
    k_cache/v_cache [num_pages, page_size, Hkv, D]; sequence b's keys are token ``j`` of page
    ``page_table[b, j // page_size]`` at offset ``j % page_size`` for ``j < cache_seqlens[b]``;
    query head h reads KV head ``h // (Hq // Hkv)``; with ``causal`` the mask is aligned to the
    bottom-right: query i of L_q sees keys ``j <= cache_seqlens[b] - L_q + i``. Only what a
    paged prefill uses: no new k/v, no window, no softcap, no LSE.
    """
    assert k is None and v is None, "the stand-in covers a prefill over the pool (no new k/v)"
    assert tuple(window_size) == (-1, -1) and not softcap and not return_softmax_lse
    total, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    result = torch.empty(total, hq, v_cache.shape[-1], dtype=q.dtype)
    keys_flat = k_cache.reshape(-1, hkv, d).double()
    values_flat = v_cache.reshape(-1, hkv, v_cache.shape[-1]).double()
    for b in range(cache_seqlens.numel()):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(cache_seqlens[b])
        j = torch.arange(n)
        slots = page_table[b, j // page_size].long() * page_size + j % page_size
        keys = keys_flat[slots].repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        values = values_flat[slots].repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), keys) * scale
        if causal:
            lq = q1 - q0
            allowed = j[None, :] <= (n - lq + torch.arange(lq))[:, None]
            scores = scores.masked_fill(~allowed[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        result[q0:q1] = torch.einsum("hqk,khd->qhd", weights, values).to(q.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


def layer(batch: Batch, **kw: Any) -> SimpleNamespace:
    """The RadixAttention fields fa3's extend reads: the torch_native harness's decoder layer
    plus head counts, logit cap and KV scales (`kw` overrides)."""
    hkv, d = batch.k.shape[1], batch.q.shape[2]
    extra = {
        "tp_v_head_num": hkv,
        "head_dim": d,
        "logit_cap": 0.0,
        "k_scale": None,
        "v_scale": None,
    }
    return attention_backend.layer(batch, **{**extra, **kw})


def backend(batch: Batch, page_size: int = 1) -> Any:
    """A `FlashAttentionBackend` (FA3, MHA) over the batch's rows and a real KV pool holding its
    cache at ``page_size``."""
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    pool = attention_backend.real_pool(batch, page_size)
    out = object.__new__(module().FlashAttentionBackend)
    fields: dict[str, Any] = {
        "is_encoder_decoder": False,
        "forward_metadata": None,
        "forward_metadata_spec_decode_expand": None,
        "max_context_len": batch.req_to_token.shape[1],
        "device": "cpu",
        "req_to_token_pool": SimpleNamespace(req_to_token=batch.req_to_token),
        "token_to_kv_pool": pool,
        "req_to_token": batch.req_to_token,
        "kv_cache_dtype": batch.k_cache.dtype,
        "kv_cache_dtype_str": "auto",
        "kv_cache_is_mxfp8": False,
        "page_size": page_size,
        "use_mla": False,
        "kv_index_translator": KVIndexTranslator(
            req_to_token=batch.req_to_token,
            token_to_kv_pool_allocator=None,
            token_to_kv_pool=pool,
            page_size=page_size,
            device="cpu",
        ),
        "skip_prefill": False,
        "attn_cp_size": 1,
        "use_sliding_window_kv_pool": False,
        "_kv_shard_pool": None,
        "topk": 0,
        "local_attn_builder": None,
        "has_local_attention": False,
        "sliding_window_size": None,
        "has_swa": False,
        "is_prefill_aware_swa": False,
        "fa_impl_ver": 3,
        "num_splits": 0,
        "full_cg_prefill_metadata": None,
        "fa_skip_kv_cache": False,
    }
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def forward(batch: Batch, fa3: Any, fb: Any, **layer_kw: Any) -> torch.Tensor:
    """`init_forward_metadata` then `forward_extend` of the batch's queries ([T, Hq, D])."""
    fa3.init_forward_metadata(fb)
    q = batch.q.reshape(batch.q.shape[0], -1)
    out = fa3.forward_extend(q, batch.k, batch.v, layer(batch, **layer_kw), fb)
    return out.view_as(batch.q)
