"""Sparse-extend hooks for sglang 0.5.23's ``TRTLLMHAAttnBackend`` (``--attention-backend
trtllm_mha``, SGLang's default on SM100/SM103; its ``trtllm_batch_context_with_kv_cache``
path). ``forward_extend`` saves the pass's KV (l.1738) before the kernel reads the page table, so
the split view (:mod:`.split_view`) needs nothing but its metadata (``cache_seqlens`` = run ends,
``cu_seqlens_q`` = run lengths, the page table of the repeated row). A view ending in one-token
runs takes SGLang's mixed decode tail for them, which attends ``[0, e)`` as a one-token extend
must. Its difference: refused under context parallelism, with attention sinks, and on metadata
not built for its view.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .hook_kit import (
    HookedBackend,
    SparseExtendUnsupported,
    SparsePath,
    SplitDifference,
    check_built_for_view,
)

TRTLLM_MHA = "trtllm_mha"


def trtllm_mha_supported(backend: Any) -> bool:
    """True iff ``backend`` (a ``TRTLLMHAAttnBackend`` instance) has none of trtllm_mha's own
    refusals: SM100's ``trtllm_batch_context_with_kv_cache`` prefill (not the SM90/SM120
    fmha_v2 one), a 16- or 32-bit KV cache (no FP8 fused write, no native FP4), no SWA pool and
    prefill wrappers present. Read through :func:`.backends.backend_serves`."""
    return (
        not bool(getattr(backend, "skip_prefill", False))
        and not bool(getattr(backend, "use_fmha_v2", False))
        and not bool(getattr(backend, "prefill_uses_native_fp4", False))
        and getattr(backend, "data_type", None) != torch.float8_e4m3fn
        and getattr(backend, "_swa_kv_pool", None) is None
    )


def _trtllm_mha_build(
    init_metadata: Callable[[Any, Any], Any], backend: Any, forward_batch: Any, view: Any
) -> tuple[Any, SparsePath]:
    from sglang.srt.layers.cp.utils import is_cp_active

    if is_cp_active(forward_batch):
        raise SparseExtendUnsupported(f"{TRTLLM_MHA}: sparse extend under context parallelism")
    return init_metadata(backend, view), SparsePath.SPLIT_VIEW


def _trtllm_mha_extend(backend: Any, forward_batch: Any, view: Any, kw: dict[str, Any]) -> Any:
    check_built_for_view(TRTLLM_MHA, backend, forward_batch)
    if kw.get("sinks") is not None:
        raise SparseExtendUnsupported(f"{TRTLLM_MHA}: sparse extend with attention sinks")
    return view


HOOKED = HookedBackend(
    TRTLLM_MHA,
    "sglang.srt.layers.attention.trtllm_mha_backend",
    "TRTLLMHAAttnBackend",
    trtllm_mha_supported,
    SplitDifference(_trtllm_mha_build, _trtllm_mha_extend),
)
