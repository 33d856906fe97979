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
    check_causal_layer,
    count_sparse_batch,
    split_batch,
)
from .split_view import is_sparse_batch, split_view_of

FLASHINFER = "flashinfer"
TRTLLM_MHA = "trtllm_mha"

SEQUENCES_ATTR = "_semblend_split_sequences"
"""Backend attribute: the split view's sequences the current metadata was built for (None when
it was built by SGLang's own code for a batch without a sparse request)."""


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


def _check_metadata(name: str, backend: Any, forward_batch: Any) -> None:
    """Raise unless the backend's metadata was built by the hook for this batch's split view."""
    built = getattr(backend, SEQUENCES_ATTR, None)
    if built is None or built != split_view_of(forward_batch).sequences:
        raise SparseExtendUnsupported(
            f"{name}: sparse extend with metadata not built for its split view"
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


def flashinfer_wrappers(cls: type) -> dict[tuple[type, str], Callable[..., Any]]:
    """Wrappers of ``cls`` (sglang's ``FlashInferAttnBackend``) built from its current
    ``init_forward_metadata``, ``init_forward_metadata_out_graph`` and ``forward_extend``, for
    :func:`.wrapping.install_wrappers`. A batch without a sparse request calls the original
    unchanged. A sparse one gets paged-path metadata over its split view and runs the original
    ``forward_extend`` on that view; it raises :class:`SparseExtendUnsupported` on a CUDA-graph
    metadata path, a configuration :func:`flashinfer_supported` rejects, a non-causal or
    sliding-window layer, a non-plain forward mode, or metadata not built for its view. The
    wrappers never change the real batch (the view is a copy) nor the backend's buffers."""
    init_metadata = cls.init_forward_metadata
    init_out_graph = cls.init_forward_metadata_out_graph
    forward_extend = cls.forward_extend

    def init_forward_metadata_hook(self: Any, forward_batch: Any) -> Any:
        setattr(self, SEQUENCES_ATTR, None)
        view = split_batch(FLASHINFER, forward_batch)
        if view is None:
            return init_metadata(self, forward_batch)
        if not flashinfer_supported(self):
            raise SparseExtendUnsupported(f"{FLASHINFER}: this backend configuration cannot split")
        use_paged = self.use_paged
        self.use_paged = True  # use_ragged = False: save this pass's KV, then read the prefix
        try:
            with _updater_room(self.indices_updater_prefill, view.batch_size):
                result = init_metadata(self, view)
        finally:
            self.use_paged = use_paged
        if getattr(self.forward_metadata, "use_ragged", True):
            raise SparseExtendUnsupported(f"{FLASHINFER}: the ragged path was chosen")
        setattr(self, SEQUENCES_ATTR, split_view_of(forward_batch).sequences)
        count_sparse_batch(SparsePath.SPLIT_VIEW, forward_batch)
        return result

    def init_out_graph_hook(self: Any, forward_batch: Any, *args: Any, **kw: Any) -> Any:
        if is_sparse_batch(forward_batch):
            raise SparseExtendUnsupported(f"{FLASHINFER}: sparse extend under a CUDA graph")
        return init_out_graph(self, forward_batch, *args, **kw)

    def forward_extend_hook(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        view = split_batch(FLASHINFER, forward_batch)
        if view is None:
            return forward_extend(self, q, k, v, layer, forward_batch, *args, **kw)
        check_causal_layer(FLASHINFER, layer)
        _check_metadata(FLASHINFER, self, forward_batch)
        if getattr(self.forward_metadata, "use_ragged", True):
            raise SparseExtendUnsupported(f"{FLASHINFER}: sparse extend on the ragged path")
        return forward_extend(self, q, k, v, layer, view, *args, **kw)

    return {
        (cls, "init_forward_metadata"): init_forward_metadata_hook,
        (cls, "init_forward_metadata_out_graph"): init_out_graph_hook,
        (cls, "forward_extend"): forward_extend_hook,
    }


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


def trtllm_mha_wrappers(cls: type) -> dict[tuple[type, str], Callable[..., Any]]:
    """Wrappers of ``cls`` (sglang's ``TRTLLMHAAttnBackend``) built from its current
    ``init_forward_metadata``, ``init_forward_metadata_out_graph`` and ``forward_extend``. A batch
    without a sparse request calls the original unchanged; a sparse one runs both originals on
    its split view. Raises :class:`SparseExtendUnsupported` for a sparse batch on a CUDA-graph
    metadata path, under context parallelism, on a configuration :func:`trtllm_mha_supported`
    rejects, on a non-causal or sliding-window layer, in a non-plain forward mode, or with
    metadata not built for its view. Never changes the real batch."""
    init_metadata = cls.init_forward_metadata
    init_out_graph = cls.init_forward_metadata_out_graph
    forward_extend = cls.forward_extend

    def init_forward_metadata_hook(self: Any, forward_batch: Any) -> Any:
        setattr(self, SEQUENCES_ATTR, None)
        view = split_batch(TRTLLM_MHA, forward_batch)
        if view is None:
            return init_metadata(self, forward_batch)
        if not trtllm_mha_supported(self):
            raise SparseExtendUnsupported(f"{TRTLLM_MHA}: this backend configuration cannot split")
        if _cp_active(forward_batch):
            raise SparseExtendUnsupported(f"{TRTLLM_MHA}: sparse extend under context parallelism")
        result = init_metadata(self, view)
        setattr(self, SEQUENCES_ATTR, split_view_of(forward_batch).sequences)
        count_sparse_batch(SparsePath.SPLIT_VIEW, forward_batch)
        return result

    def init_out_graph_hook(self: Any, forward_batch: Any, *args: Any, **kw: Any) -> Any:
        if is_sparse_batch(forward_batch):
            raise SparseExtendUnsupported(f"{TRTLLM_MHA}: sparse extend under a CUDA graph")
        return init_out_graph(self, forward_batch, *args, **kw)

    def forward_extend_hook(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        view = split_batch(TRTLLM_MHA, forward_batch)
        if view is None:
            return forward_extend(self, q, k, v, layer, forward_batch, *args, **kw)
        check_causal_layer(TRTLLM_MHA, layer)
        _check_metadata(TRTLLM_MHA, self, forward_batch)
        if kw.get("sinks") is not None:
            raise SparseExtendUnsupported(f"{TRTLLM_MHA}: sparse extend with attention sinks")
        return forward_extend(self, q, k, v, layer, view, *args, **kw)

    return {
        (cls, "init_forward_metadata"): init_forward_metadata_hook,
        (cls, "init_forward_metadata_out_graph"): init_out_graph_hook,
        (cls, "forward_extend"): forward_extend_hook,
    }
