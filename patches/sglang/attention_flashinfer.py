"""Sparse-extend hooks for sglang 0.5.23's ``FlashInferAttnBackend`` and ``TRTLLMHAAttnBackend``:
a batch holding a sparse request reaches the backend's own metadata code and kernel call as its
split view (:mod:`.split_view`: each computed run of a sparse request as one ordinary extend
sequence, prefix ``s``, extend ``e - s``). Batches without a sparse request go to SGLang's
untouched originals.

flashinfer: ``init_forward_metadata`` decides ``use_ragged`` (``flashinfer_backend.py`` l.1058:
``not enable_deterministic and not is_in_tc_piecewise_cuda_graph() and not use_paged``). The
ragged path runs causal attention over this pass's fresh k/v plus the paged *prefix* non-causally
and saves the pass's KV after (``forward_extend`` l.1397-1517), so a later run's prefix would
miss the KV that earlier runs of the same request compute in this pass. For a batch holding a
sparse request the hook builds the metadata with ``use_paged`` on (SGLang's own
``SGLANG_FLASHINFER_USE_PAGED`` switch, so ``use_ragged`` is False): ``forward_extend`` then
saves the pass's KV first and runs ``prefill_wrapper_paged.forward(causal=True)`` over prefix +
extend (bottom-right causal), which is what each run needs.

trtllm_mha (SM100's ``trtllm_batch_context_with_kv_cache`` path): ``forward_extend`` saves the
pass's KV (l.1738) before the kernel reads the page table, so the split view needs nothing but
its metadata (``cache_seqlens`` = run ends, ``cu_seqlens_q`` = run lengths, the page table of the
repeated row). A view ending in one-token runs takes SGLang's mixed decode tail for them, which
attends ``[0, e)`` as a one-token extend must.

Paths that cannot carry a sparse batch raise :class:`.split_hooks.SparseExtendUnsupported`
naming the backend; the ``*_supported`` predicates tell callers beforehand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .split_hooks import (
    SparseExtendUnsupported,
    SparsePath,
    SplitDifference,
    check_built_for_view,
    split_view_wrappers,
)
from .wrapping import Wrappers

FLASHINFER = "flashinfer"
TRTLLM_MHA = "trtllm_mha"


def _dcp_size() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), "attn_dcp_size", 1) or 1)
    except Exception:
        return 1


def _reads_translated(backend: Any) -> bool:
    """A unified (translating) pool reads page tables through the iteration's plan, which is
    built for the real batch's rows, not the view's."""
    translator = getattr(backend, "kv_index_translator", None)
    return bool(getattr(translator, "is_translating", False)) or bool(
        getattr(translator, "reads_are_translated", False)
    )


# -------------------------------------------------------------------------------- flashinfer
def flashinfer_supported(backend: Any) -> bool:
    """True iff ``backend`` (a ``FlashInferAttnBackend`` instance) can carry a sparse extend with
    the hooks installed: it has prefill wrappers, one wrapper (no sliding window or cross
    attention), no sliding-window KV pool, no multi-item scoring, no dLLM, no FP4 dequant
    workspace, no translating (unified) pool and no decode context parallelism. Read by the
    attention registry and the hooks; never raises (False on anything unexpected)."""
    try:
        return (
            not bool(getattr(backend, "skip_prefill", False))
            and getattr(backend, "dispatch_reason", None) is None
            and int(getattr(backend, "num_wrappers", 1)) == 1
            and not bool(getattr(backend, "use_sliding_window_kv_pool", False))
            and not bool(getattr(backend, "enable_mis", False))
            and not bool(getattr(backend, "is_dllm_model", False))
            and not bool(getattr(backend, "prefill_uses_dequant_workspace", False))
            and not _reads_translated(backend)
            and _dcp_size() == 1
        )
    except Exception:
        return False


@contextlib.contextmanager
def _updater_room(updater: Any, n: int) -> Iterator[None]:
    """Within the block, the prefill indices updater's per-sequence buffers hold at least ``n``
    sequences: SGLang sizes ``kv_indptr``/``qo_indptr`` (one per wrapper, ``max_bs + 1``) and
    ``kv_last_page_len`` (``max_bs``, all ones: flashinfer is planned at page size 1) by the
    request pool, and a split view may hold more sequences. Larger buffers of the same dtype
    and device are lent (``kv_last_page_len`` filled with ones, as SGLang's) and the updater's
    own put back after; the backend's lists are never mutated. The planned wrappers keep the
    slices they were given, as with :func:`.split_hooks.scratch_room`."""
    saved: dict[str, Any] = {}
    for name in ("kv_indptr", "qo_indptr"):
        bufs = getattr(updater, name, None)
        if isinstance(bufs, list) and any(b.shape[0] < n + 1 for b in bufs):
            saved[name] = bufs
            setattr(
                updater,
                name,
                [torch.zeros(n + 1, dtype=b.dtype, device=b.device) for b in bufs],
            )
    last = getattr(updater, "kv_last_page_len", None)
    if isinstance(last, torch.Tensor) and last.shape[0] < n:
        saved["kv_last_page_len"] = last
        updater.kv_last_page_len = torch.ones(n, dtype=last.dtype, device=last.device)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(updater, name, value)


def _flashinfer_build(
    init_metadata: Callable[[Any, Any], Any], backend: Any, forward_batch: Any, view: Any
) -> tuple[Any, SparsePath]:
    """flashinfer's metadata for a split view: planned on the paged path (``use_paged`` on for
    the call, the updater's buffers roomy enough); raises if the ragged path was still chosen."""
    use_paged = backend.use_paged
    backend.use_paged = True  # use_ragged = False: save this pass's KV, then read the prefix
    try:
        with _updater_room(backend.indices_updater_prefill, view.batch_size):
            result = init_metadata(backend, view)
    finally:
        backend.use_paged = use_paged
    if getattr(backend.forward_metadata, "use_ragged", True):
        raise SparseExtendUnsupported(f"{FLASHINFER}: the ragged path was chosen")
    return result, SparsePath.SPLIT_VIEW


def _flashinfer_extend(backend: Any, forward_batch: Any, view: Any, kw: dict[str, Any]) -> Any:
    check_built_for_view(FLASHINFER, backend, forward_batch)
    if getattr(backend.forward_metadata, "use_ragged", True):
        raise SparseExtendUnsupported(f"{FLASHINFER}: sparse extend on the ragged path")
    return view


def flashinfer_wrappers(cls: type) -> Wrappers:
    """The split-view wrappers of ``cls`` (sglang's ``FlashInferAttnBackend``): metadata planned
    on the paged path over the view, and ``forward_extend`` refused on metadata not built for its
    view or on the ragged path. Installed by :func:`.attention.install_attention_hooks`."""
    return split_view_wrappers(
        FLASHINFER,
        cls,
        SplitDifference(flashinfer_supported, _flashinfer_build, _flashinfer_extend),
    )


# -------------------------------------------------------------------------------- trtllm_mha
def trtllm_mha_supported(backend: Any) -> bool:
    """True iff ``backend`` (a ``TRTLLMHAAttnBackend`` instance) can carry a sparse extend with
    the hooks installed: SM100's ``trtllm_batch_context_with_kv_cache`` prefill (not the
    SM90/SM120 fmha_v2 one), a 16- or 32-bit KV cache (no FP8 fused write, no native FP4), no
    sliding-window pool, no translating (unified) pool, no decode context parallelism and prefill
    wrappers present. Read by the attention registry and the hooks; never raises."""
    try:
        return (
            not bool(getattr(backend, "skip_prefill", False))
            and not bool(getattr(backend, "use_fmha_v2", False))
            and not bool(getattr(backend, "prefill_uses_native_fp4", False))
            and getattr(backend, "data_type", None) != torch.float8_e4m3fn
            and getattr(backend, "_swa_kv_pool", None) is None
            and not bool(getattr(backend, "use_sliding_window_kv_pool", False))
            and not _reads_translated(backend)
            and _dcp_size() == 1
        )
    except Exception:
        return False


def _cp_active(forward_batch: Any) -> bool:
    from sglang.srt.layers.cp.utils import is_cp_active

    return bool(is_cp_active(forward_batch))


def _trtllm_mha_build(
    init_metadata: Callable[[Any, Any], Any], backend: Any, forward_batch: Any, view: Any
) -> tuple[Any, SparsePath]:
    if _cp_active(forward_batch):
        raise SparseExtendUnsupported(f"{TRTLLM_MHA}: sparse extend under context parallelism")
    return init_metadata(backend, view), SparsePath.SPLIT_VIEW


def _trtllm_mha_extend(backend: Any, forward_batch: Any, view: Any, kw: dict[str, Any]) -> Any:
    check_built_for_view(TRTLLM_MHA, backend, forward_batch)
    if kw.get("sinks") is not None:
        raise SparseExtendUnsupported(f"{TRTLLM_MHA}: sparse extend with attention sinks")
    return view


def trtllm_mha_wrappers(cls: type) -> Wrappers:
    """The split-view wrappers of ``cls`` (sglang's ``TRTLLMHAAttnBackend``): refused under
    context parallelism, on metadata not built for its view, and with attention sinks.
    Installed by :func:`.attention.install_attention_hooks`."""
    return split_view_wrappers(
        TRTLLM_MHA,
        cls,
        SplitDifference(trtllm_mha_supported, _trtllm_mha_build, _trtllm_mha_extend),
    )
