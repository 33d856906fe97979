"""What every attention backend's sparse-extend hooks share: the error a sparse batch raises on a
path that cannot carry it, the split view of a batch, the causal-layer check, and room in a
backend's per-sequence scratch buffers for a view with more sequences than SGLang sized them for.

Callers: the per-backend hook modules (:mod:`.attention`, :mod:`.attention_fa3`,
:mod:`.attention_flashinfer`). Nothing here changes SGLang or the batch it is given.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from .split_view import is_sparse_batch, split_view_of


class SparsePath(enum.StrEnum):
    """How a batch holding a sparse request was attended: as its split view through the
    backend's own metadata, or masked by position (triton's custom mask, torch_native's
    query-only extend)."""

    SPLIT_VIEW = "split_view"
    POSITION_MASK = "position_mask"


_paths: Counter[str] = Counter()
_paths_lock = threading.Lock()


COUNTED_ATTR = "_semblend_sparse_path_counted"
"""Attribute of a ForwardBatch already counted by :func:`count_sparse_batch`."""


def count_sparse_batch(path: SparsePath, forward_batch: Any) -> None:
    """Count ``forward_batch`` (holding a sparse request) once on ``path``: the hooks call it
    every time they route it (per layer, or per metadata build after a check layer shrank it);
    only the first call for a batch object counts."""
    if getattr(forward_batch, COUNTED_ATTR, False):
        return
    try:
        setattr(forward_batch, COUNTED_ATTR, True)
    except AttributeError:  # a batch that takes no attributes: counted every time
        pass
    with _paths_lock:
        _paths[path.value] += 1


def sparse_batch_counts() -> dict[str, int]:
    """Batches holding a sparse request this process attended, by :class:`SparsePath` value
    (every path present, 0 when unused); read by the runtime's snapshot."""
    with _paths_lock:
        return {path.value: _paths[path.value] for path in SparsePath}


class SparseExtendUnsupported(RuntimeError):
    """A batch holding a sparse request reached an attention path that cannot mask by position."""


def is_plain_extend(forward_batch: Any) -> bool:
    """True for an EXTEND or MIXED batch (not a draft, verify, idle or split-prefill one)."""
    mode = forward_batch.forward_mode
    return bool(mode.is_extend()) and (mode.name in ("EXTEND", "MIXED"))


def split_batch(backend: str, forward_batch: Any) -> Any | None:
    """The split view's batch of ``forward_batch`` when it holds a sparse request, else None.

    Raises :class:`SparseExtendUnsupported` (naming ``backend``) for a sparse batch that is not
    a plain EXTEND/MIXED batch, has encoder lens, or lacks usable positions.
    """
    if not is_sparse_batch(forward_batch):
        return None
    encoder = getattr(forward_batch, "encoder_lens", None)
    if not is_plain_extend(forward_batch) or encoder is not None:
        raise SparseExtendUnsupported(
            f"{backend}: sparse extend in a {forward_batch.forward_mode.name} batch"
        )
    try:
        return split_view_of(forward_batch).batch
    except ValueError as exc:
        raise SparseExtendUnsupported(f"{backend}: {exc}") from exc


def check_causal_layer(backend: str, layer: Any) -> None:
    """Raise unless ``layer`` is causal self-attention (a split run sees only its prefix)."""
    kind = getattr(getattr(layer, "attn_type", None), "name", "DECODER")
    if getattr(layer, "is_cross_attention", False) or kind != "DECODER":
        raise SparseExtendUnsupported(f"{backend}: sparse extend on a {kind} layer")
    window = getattr(layer, "sliding_window_size", None)
    if window is not None and window > -1:
        raise SparseExtendUnsupported(f"{backend}: sparse extend on a sliding-window layer")


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
