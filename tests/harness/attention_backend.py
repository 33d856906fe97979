"""sglang's real `TorchNativeAttnBackend.forward_extend` run on a random EXTEND batch
(tests/sparse_extend_batches.py), and the dense float64 reference it must match.

`forward` builds the backend without a model runner (the pool, rows and layer fields
`forward_extend` reads) and runs it with whatever attention hooks are installed;
`forward_batch` is the batch as sglang's real ForwardBatch; `reference` is
`extend_attention_reference` with an explicit position mask. Works on every sglang version
semblend serves (0.5.23 in `make test`, 0.5.15 in `make test-legacy`); sglang is imported when
called.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from semblend_sglang.kernels.sparse_extend import extend_attention_reference
from tests.sparse_extend_batches import Batch

ATOL = 2e-5
"""Tolerance of a float32 backend output against the float64 reference."""


class Pool:
    """A one-layer KV pool with the three methods torch_native uses."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k.clone(), v.clone()

    def set_kv_buffer(self, layer: Any, loc: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the computed tokens' K/V at their slots (``loc.loc``)."""
        self.k[loc.loc] = k.view(-1, *self.k.shape[1:])
        self.v[loc.loc] = v.view(-1, *self.v.shape[1:])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The K cache."""
        return self.k

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The V cache."""
        return self.v


def real_pool(batch: Batch, page_size: int = 1) -> Any:
    """SGLang's real one-layer `MHATokenToKVPool` at ``page_size`` (its size the batch's slots
    rounded up to whole pages) holding the batch's cache: what the triton, fa3, flashinfer and
    trtllm_mha harnesses read KV from."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    slots, hkv, d = batch.k_cache.shape
    pool = MHATokenToKVPool(
        size=-(-slots // page_size) * page_size,
        page_size=page_size,
        dtype=batch.k_cache.dtype,
        head_num=hkv,
        head_dim=d,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    pool.k_buffer[0][:slots] = batch.k_cache
    pool.v_buffer[0][:slots] = batch.v_cache
    return pool


def backend(batch: Batch) -> Any:
    """A `TorchNativeAttnBackend` over the batch's rows and a copy of its cache."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    out = object.__new__(TorchNativeAttnBackend)
    out.req_to_token_pool = SimpleNamespace(req_to_token=batch.req_to_token)
    out.token_to_kv_pool = Pool(batch.k_cache, batch.v_cache)
    out.use_sliding_window_kv_pool = False
    out.swa_out_cache_loc = None
    out.device = "cpu"
    return out


def layer(batch: Batch, **kw: Any) -> SimpleNamespace:
    """The RadixAttention fields `forward_extend` reads (a decoder layer; `kw` overrides)."""
    from sglang.srt.layers.radix_attention import AttentionType

    hq, hkv, d = batch.q.shape[1], batch.k.shape[1], batch.q.shape[2]
    fields = {
        "tp_q_head_num": hq,
        "tp_k_head_num": hkv,
        "qk_head_dim": d,
        "v_head_dim": d,
        "is_cross_attention": False,
        "attn_type": AttentionType.DECODER,
        "scaling": d**-0.5,
        "sliding_window_size": -1,
        "layer_id": 0,
    }
    return SimpleNamespace(**{**fields, **kw})


def forward_batch(batch: Batch, **kw: Any) -> Any:
    """The batch as sglang's real EXTEND ``ForwardBatch`` (`kw` overrides fields)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    extend = batch.extend_seq_lens
    starts = torch.cumsum(extend, 0) - extend
    fields = {
        "forward_mode": ForwardMode.EXTEND,
        "batch_size": int(batch.seq_lens.numel()),
        "input_ids": torch.zeros(batch.positions.numel(), dtype=torch.int64),
        "req_pool_indices": batch.req_pool_indices,
        "seq_lens": batch.seq_lens,
        "seq_lens_cpu": batch.seq_lens,
        "seq_lens_sum": int(batch.seq_lens.sum()),
        "out_cache_loc": batch.out_cache_loc,
        "extend_prefix_lens": batch.extend_prefix_lens,
        "extend_prefix_lens_cpu": batch.extend_prefix_lens.tolist(),
        "extend_seq_lens": extend,
        "extend_seq_lens_cpu": extend.tolist(),
        "extend_start_loc": starts,
        "extend_num_tokens": int(extend.sum()),
        "positions": batch.positions,
    }
    return ForwardBatch(**{**fields, **kw})


def forward(batch: Batch, *, fb: Any = None, **layer_kw: Any) -> torch.Tensor:
    """`forward_extend` of the batch's queries ([T, Hq, D]), with the installed hooks."""
    native = backend(batch)
    q = batch.q.reshape(batch.q.shape[0], -1)
    out = native.forward_extend(
        q, batch.k, batch.v, layer(batch, **layer_kw), fb or forward_batch(batch)
    )
    return out.view_as(batch.q)


def reference(batch: Batch) -> torch.Tensor:
    """The dense float64 reference with an explicit position mask."""
    return extend_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.rows())
