"""Sparse-extend hooks for sglang 0.5.23's ``TritonAttnBackend`` (``--attention-backend
triton``). ``init_forward_metadata`` and ``forward_extend`` get the split view (the kernel saves
the pass's KV before it reads the prefix) when it costs no more tile work than one
position-masked pass per request (:func:`split_is_cheaper`); otherwise SGLang's
metadata for the real batch is replaced by :func:`build_sparse_extend_metadata`'s and the kernel
runs with ``skip_prefix_custom_mask=False``. Many short runs make the split view slow (each run
reads its whole prefix again; docs/perf.md, "Split view on a GPU").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from semblend_sglang.config import SPARSE_PATHS
from semblend_sglang.kernels.sparse_extend import ExtendRows
from semblend_sglang.kernels.sparse_extend_triton import (
    SKIP_PREFIX_CUSTOM_MASK,
    build_sparse_extend_metadata,
)

from ..wrapping import Wrappers
from .hook_kit import (
    BUILT_ATTR,
    HookedBackend,
    SparseExtendUnsupported,
    SparsePath,
    SplitDifference,
)
from .split_view import SplitSequences, batch_lens, split_view_of
from .torch_native_backend import query_positions

_sparse_path = "auto"
"""The ``sparse_path`` setting (:func:`set_sparse_path`)."""


def triton_supported(backend: Any) -> bool:
    """True iff a ``TritonAttnBackend`` instance has none of triton's own refusals
    (deterministic mode, dLLM, a sliding window). Read through :func:`.backends.backend_serves`."""
    swa = getattr(backend, "sliding_window_size", None)
    return (
        not getattr(backend, "enable_deterministic", False)
        and getattr(backend, "dllm_attention", None) is None
        and (swa is None or swa <= 0)
    )


TILE = 64
"""Query and key tile edge of :func:`tile_work` (SGLang's Triton extend kernel tiles 64 or 128
queries by 64 keys)."""


def tile_work(extend: list[int], seq: list[int]) -> int:
    """Tile pairs a prefix + causal-extend kernel visits for sequences of ``extend`` queries over
    ``seq`` keys: ``sum(ceil(e / TILE) * ceil(n / TILE))``. A split run pays for its whole
    prefix again, so many short runs cost more than one position-masked pass over the request."""
    return sum(-(-e // TILE) * -(-n // TILE) for e, n in zip(extend, seq, strict=True))


def split_is_cheaper(forward_batch: Any, seqs: SplitSequences) -> bool:
    """Whether the split view's sequences cost no more tile work than the real batch's requests
    run with a position mask (one sequence per request): the choice a backend that has both
    paths (triton) makes per batch (docs/perf.md, "Split view on a GPU")."""
    lens = batch_lens(forward_batch)
    if lens is None:
        return True
    _, extend, seq = lens
    return tile_work(seqs.extend, seqs.seq) <= tile_work(extend, seq)


@contextlib.contextmanager
def scratch_room(backend: Any, names: tuple[str, ...], length: int) -> Iterator[None]:
    """Within the block, each of ``backend``'s 1-D scratch buffers ``names`` shorter than
    ``length`` is a zeroed buffer of ``length`` (same dtype and device); the originals are put
    back after. A split view may hold more sequences than SGLang sized these buffers for (its
    request pool); the metadata built inside keeps slices of the larger ones, and CUDA-graph
    replay, which captured the originals, never sees them."""
    saved: dict[str, Any] = {}
    for name in names:
        buf = getattr(backend, name, None)
        if isinstance(buf, torch.Tensor) and buf.dim() == 1 and buf.shape[0] < length:
            saved[name] = buf
            setattr(backend, name, torch.zeros(length, dtype=buf.dtype, device=buf.device))
    try:
        yield
    finally:
        for name, buf in saved.items():
            setattr(backend, name, buf)


TRITON_SCRATCH = ("kv_indptr", "qo_indptr", "mask_indptr")
"""TritonAttnBackend's per-sequence buffers sized by the request pool (``max_bs + 1``)."""


def _mask_metadata(backend: Any, forward_batch: Any) -> None:
    """Replace the extend metadata SGLang just built for the real batch with the position-mask
    metadata (:func:`build_sparse_extend_metadata`)."""
    info = query_positions(forward_batch)
    if info is None:
        raise SparseExtendUnsupported("triton: sparse extend without query positions")
    md = build_sparse_extend_metadata(
        ExtendRows(
            backend.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            forward_batch.extend_seq_lens,
            info[0],
        )
    )
    meta = backend.forward_metadata
    backend.forward_metadata = dataclasses.replace(
        meta,
        qo_indptr=md.qo_indptr.to(meta.qo_indptr.dtype),
        kv_indptr=md.kv_indptr.to(meta.kv_indptr.dtype),
        kv_indices=md.kv_indices,
        custom_mask=md.custom_mask,
        mask_indptr=md.mask_indptr,
        max_extend_len=md.max_extend_len,
    )


def _split_chosen(forward_batch: Any, seqs: Any) -> bool:
    """triton: attend this sparse batch as its split view (else with the position mask): as
    :func:`set_sparse_path` pinned it, or by :func:`split_is_cheaper` under ``auto``."""
    if _sparse_path == "auto":
        return split_is_cheaper(forward_batch, seqs)
    return _sparse_path == SparsePath.SPLIT_VIEW.value


def _triton_build(
    init_metadata: Callable[[Any, Any], Any], backend: Any, forward_batch: Any, view: Any
) -> tuple[Any, SparsePath]:
    """triton's metadata for a sparse batch: SGLang's over the split view (its scratch buffers
    roomy enough) when chosen, else SGLang's for the real batch replaced by the mask's."""
    seqs = split_view_of(forward_batch).sequences
    if seqs is not None and _split_chosen(forward_batch, seqs):
        with scratch_room(backend, TRITON_SCRATCH, view.batch_size + 1):
            return init_metadata(backend, view), SparsePath.SPLIT_VIEW
    result = init_metadata(backend, forward_batch)
    _mask_metadata(backend, forward_batch)
    return result, SparsePath.POSITION_MASK


def _masked(backend: Any) -> bool:
    """The backend's current metadata is the position mask's (built by :func:`_triton_build`)."""
    return getattr(backend, BUILT_ATTR, None) is backend.forward_metadata


def _kernel_wrapper(triton_cls: type) -> Wrappers:
    run_kernel = triton_cls._forward_extend_kernel

    def forward_extend_kernel_hook(self: Any, layer: Any, *args: Any, **kw: Any) -> Any:
        if _masked(self):
            kw["skip_prefix_custom_mask"] = SKIP_PREFIX_CUSTOM_MASK
        return run_kernel(self, layer, *args, **kw)

    return {(triton_cls, "_forward_extend_kernel"): forward_extend_kernel_hook}


def set_sparse_path(path: str) -> None:
    """Pin how triton attends a batch holding a sparse request: ``auto`` (by tile work),
    ``split_view`` or ``position_mask`` (the ``sparse_path`` setting; the scheduler's start-up
    hook calls it, :func:`.backends.remove_attention_hooks` resets it). ValueError on another
    value. Other backends have one path."""
    global _sparse_path
    if path not in SPARSE_PATHS:
        raise ValueError(f"sparse_path {path!r}: expected one of {SPARSE_PATHS}")
    _sparse_path = path


HOOKED = HookedBackend(
    "triton",
    "sglang.srt.layers.attention.triton_backend",
    "TritonAttnBackend",
    triton_supported,
    SplitDifference(
        _triton_build, lambda b, batch, view, kw: batch if _masked(b) else view, _kernel_wrapper
    ),
)
