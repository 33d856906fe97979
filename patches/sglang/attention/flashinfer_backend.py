"""Sparse-extend hooks for sglang 0.5.23's ``FlashInferAttnBackend`` (``--attention-backend
flashinfer``): a batch holding a sparse request reaches the backend's own metadata code and
kernel call as its split view (:mod:`.split_view`).

``init_forward_metadata`` decides ``use_ragged`` (``flashinfer_backend.py`` l.1058:
``not enable_deterministic and not is_in_tc_piecewise_cuda_graph() and not use_paged``). The
ragged path runs causal attention over this pass's fresh k/v plus the paged *prefix* non-causally
and saves the pass's KV after (``forward_extend`` l.1397-1517), so a later run's prefix would
miss the KV that earlier runs of the same request compute in this pass. For a batch holding a
sparse request the hook builds the metadata with ``use_paged`` on (SGLang's own
``SGLANG_FLASHINFER_USE_PAGED`` switch, so ``use_ragged`` is False): ``forward_extend`` then
saves the pass's KV first and runs ``prefill_wrapper_paged.forward(causal=True)`` over prefix +
extend (bottom-right causal), which is what each run needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .hook_kit import (
    HookedBackend,
    SparseExtendUnsupported,
    SparsePath,
    SplitDifference,
    check_built_for_view,
)

FLASHINFER = "flashinfer"


def flashinfer_supported(backend: Any) -> bool:
    """True iff ``backend`` (a ``FlashInferAttnBackend`` instance) has none of flashinfer's own
    refusals: it has prefill wrappers, one wrapper (no sliding window or cross attention), no
    multi-item scoring, no dLLM, no FP4 dequant workspace. Read through
    :func:`.backends.backend_serves`."""
    return (
        not bool(getattr(backend, "skip_prefill", False))
        and getattr(backend, "dispatch_reason", None) is None
        and int(getattr(backend, "num_wrappers", 1)) == 1
        and not bool(getattr(backend, "enable_mis", False))
        and not bool(getattr(backend, "is_dllm_model", False))
        and not bool(getattr(backend, "prefill_uses_dequant_workspace", False))
    )


@contextlib.contextmanager
def _updater_room(updater: Any, n: int) -> Iterator[None]:
    """Within the block, the prefill indices updater's per-sequence buffers hold at least ``n``
    sequences: SGLang sizes ``kv_indptr``/``qo_indptr`` (one per wrapper, ``max_bs + 1``) and
    ``kv_last_page_len`` (``max_bs``, all ones: flashinfer is planned at page size 1) by the
    request pool, and a split view may hold more sequences. Larger buffers of the same dtype
    and device are lent (``kv_last_page_len`` filled with ones, as SGLang's) and the updater's
    own put back after; the backend's lists are never mutated. The planned wrappers keep the
    slices they were given, as with :func:`.triton_backend.scratch_room`."""
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


HOOKED = HookedBackend(
    FLASHINFER,
    "sglang.srt.layers.attention.flashinfer_backend",
    "FlashInferAttnBackend",
    flashinfer_supported,
    SplitDifference(_flashinfer_build, _flashinfer_extend),
)
