"""sglang 0.5.23's real `TritonAttnBackend` on CPU, for an EXTEND forward of a random batch
(tests/sparse_extend_batches.py) under TRITON_INTERPRET=1.

`backend` builds the class without a model runner (its `__init__` needs a CUDA/runtime context):
it sets exactly the attributes `init_forward_metadata`'s extend branch and `forward_extend`'s
paged-extend path read, with SGLang's values for a plain MHA model at the page size asked for,
and SGLang's
own `KVIndexTranslator`, `MHATokenToKVPool` and `extend_attention_fwd`. Its per-sequence buffers
are sized by ``max_bs`` as SGLang sizes them by the request pool. `forward` runs the two methods
(hooked or not, whatever is installed) and returns the attention output.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests.harness import attention_backend
from tests.harness.attention_backend import forward_batch
from tests.sparse_extend_batches import Batch


def layer(batch: Batch, **kw: Any) -> SimpleNamespace:
    """The RadixAttention fields the triton extend reads: the torch_native harness's decoder
    layer plus the logit-cap, KV-scale and temperature fields (`kw` overrides)."""
    extra = {
        "logit_cap": 0.0,
        "logit_capping_method": "tanh",
        "k_scale": None,
        "v_scale": None,
        "xai_temperature_len": -1,
    }
    return attention_backend.layer(batch, **{**extra, **kw})


def backend(batch: Batch, max_bs: int = 8, page_size: int = 1) -> Any:
    """A `TritonAttnBackend` over the batch's rows and a real KV pool holding its cache at
    ``page_size`` (the batch's rows laid out in whole pages when it is > 1)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    pool = attention_backend.real_pool(batch, page_size)
    out = object.__new__(TritonAttnBackend)
    import sglang.kernels.ops.attention.extend_attention as kernels

    fields: dict[str, Any] = {
        "extend_attention_fwd": kernels.extend_attention_fwd,
        "dllm_attention": None,
        "_dense_one_shot_kv_indptr": None,
        "sliding_window_size": None,
        "window_kv_indptr": None,
        "use_sliding_window_kv_pool": False,
        "dcp_size": 1,
        "dcp_rank": 0,
        "enable_deterministic": False,
        "use_mla": False,
        "use_dense_fp8_chunked_prefill": False,
        "use_verify_splitkv": False,
        "use_verify_shared_kv": False,
        "page_size": page_size,
        "device": "cpu",
        "max_context_len": batch.req_to_token.shape[1],
        "req_to_token": batch.req_to_token,
        "req_to_token_pool": SimpleNamespace(req_to_token=batch.req_to_token, size=max_bs),
        "token_to_kv_pool": pool,
        "kv_index_translator": KVIndexTranslator(
            req_to_token=batch.req_to_token,
            token_to_kv_pool_allocator=None,
            token_to_kv_pool=pool,
            page_size=page_size,
            device="cpu",
        ),
        "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32),
        "qo_indptr": torch.zeros(max_bs + 1, dtype=torch.int64),
        "mask_indptr": torch.zeros(max_bs + 1, dtype=torch.int64),
        "forward_metadata": None,
    }
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def forward(batch: Batch, *, triton: Any = None, fb: Any = None, **layer_kw: Any) -> torch.Tensor:
    """`init_forward_metadata` then `forward_extend` of the batch's queries ([T, Hq, D])."""
    triton = triton or backend(batch)
    fb = fb or forward_batch(batch)
    triton.init_forward_metadata(fb)
    q = batch.q.reshape(batch.q.shape[0], -1)
    out = triton.forward_extend(q, batch.k, batch.v, layer(batch, **layer_kw), fb)
    return out.view_as(batch.q)
