"""The hook kit every attention backend's sparse-extend hooks are built with, on the split view
(:mod:`.split_view`): :class:`HookedBackend` (one backend as data, each ``<name>_backend``
module's), the one factory of its wrappers (:func:`split_view_wrappers`), the error a sparse
batch raises on a path that cannot carry it, the count of sparse batches per path, and the
CUDA-graph rule (:func:`graph_can_carry`). Nothing here changes SGLang or the batch it is given.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..wrapping import Wrappers
from .split_view import forward_notes, is_sparse_batch, split_view_of


class SparsePath(enum.StrEnum):
    """How a batch holding a sparse request was attended: as its split view through the
    backend's own metadata, or masked by position (triton's custom mask, torch_native's
    query-only extend)."""

    SPLIT_VIEW = "split_view"
    POSITION_MASK = "position_mask"


_paths: Counter[str] = Counter()
_paths_lock = threading.Lock()


def count_sparse_batch(path: SparsePath, forward_batch: Any) -> None:
    """Count ``forward_batch`` (holding a sparse request) once on ``path``: the hooks call it
    each time they route it; only the first call for a batch object counts (its notes remember;
    a batch that takes no attributes is counted every time)."""
    notes = forward_notes(forward_batch)
    if notes.counted:
        return
    notes.counted = True
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
    a plain EXTEND/MIXED batch, has encoder lens, or lacks usable positions."""
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


def graph_can_carry(forward_batch: Any) -> bool:
    """The CUDA-graph rule: a batch holding a sparse request never runs CUDA-graph attention
    metadata (built for the real batch, it cannot carry the split view). Read by
    :func:`split_view_wrappers` and :func:`.unified.prefill_graph_wrappers`."""
    return not is_sparse_batch(forward_batch)


BUILT_ATTR = "_semblend_built_for"
"""Backend attribute: what :func:`split_view_wrappers` built its current metadata for (the split
view's sequences, or the position-mask metadata object); None when SGLang's own code built it."""

MetadataBuild = Callable[[Callable[[Any, Any], Any], Any, Any, Any], tuple[Any, SparsePath]]
"""(SGLang's ``init_forward_metadata``, backend, real batch, its split view's batch) -> (the
original's result, the path taken); may raise :class:`SparseExtendUnsupported`. Default: the
original run on the view."""

ExtendBatch = Callable[[Any, Any, Any, dict[str, Any]], Any]
"""(backend, real batch, split view's batch, ``forward_extend``'s keywords) -> the batch the
original ``forward_extend`` runs on; may raise :class:`SparseExtendUnsupported`. Default: the
view."""


def check_built_for_view(name: str, backend: Any, forward_batch: Any) -> None:
    """Raise unless ``backend``'s metadata was built by its wrapper for this batch's split view."""
    built = getattr(backend, BUILT_ATTR, None)
    if built is None or built != split_view_of(forward_batch).sequences:
        raise SparseExtendUnsupported(
            f"{name}: sparse extend with metadata not built for its split view"
        )


Serves = Callable[[Any], bool]
"""Whether a backend instance can carry a sparse extend: :mod:`.backends`'s common refusals and
the backend's own, composed by :func:`.backends.backend_serves`; never raises."""


@dataclass(frozen=True)
class SplitDifference:
    """What one backend's wrappers do beyond the common three (:func:`split_view_wrappers`): how
    its metadata is built for a sparse batch, which batch its ``forward_extend`` runs on, and any
    wrappers of other methods (built from ``cls``)."""

    build: MetadataBuild | None = None
    extend: ExtendBatch | None = None
    extra: Callable[[type], Wrappers] | None = None


@dataclass(frozen=True)
class HookedBackend:
    """One backend the hooks serve, as data: its ``--attention-backend`` name, its sglang module
    and class, its own refusals beyond :mod:`.backends`'s common ones, and its difference (a
    :class:`SplitDifference`, or a function building its own wrappers from the class and its
    full predicate). Each ``attention_<name>`` module exports one as ``HOOKED``."""

    name: str
    module: str
    cls: str
    supported: Serves
    difference: SplitDifference | Callable[[type, Serves], Wrappers] = SplitDifference()

    def wrappers(self, cls: type, serves: Serves) -> Wrappers:
        """The wrappers of ``cls`` (this backend's sglang class) built from its current
        originals, refusing an instance ``serves`` rejects."""
        if isinstance(self.difference, SplitDifference):
            return split_view_wrappers(self.name, cls, serves, self.difference)
        return self.difference(cls, serves)


def split_view_wrappers(name: str, cls: type, serves: Serves, diff: SplitDifference) -> Wrappers:
    """Wrappers of ``cls``'s ``init_forward_metadata``, ``init_forward_metadata_out_graph`` and
    ``forward_extend`` (plus ``diff.extra``), built from the current originals for
    :func:`.wrapping.install_wrappers`. A batch without a sparse request calls each original
    unchanged. A sparse one gets ``diff.build``'s metadata and runs the original
    ``forward_extend`` on ``diff.extend``'s batch; it raises :class:`SparseExtendUnsupported`
    naming ``name`` on an instance ``serves`` rejects, under CUDA-graph metadata
    (:func:`graph_can_carry`), on a non-causal or sliding-window layer, or in a non-plain
    forward mode. The real batch is never changed."""
    init_metadata = cls.init_forward_metadata
    init_out_graph = cls.init_forward_metadata_out_graph
    forward_extend = cls.forward_extend

    def init_forward_metadata_hook(self: Any, forward_batch: Any) -> Any:
        setattr(self, BUILT_ATTR, None)
        view = split_batch(name, forward_batch)
        if view is None:
            return init_metadata(self, forward_batch)
        if not serves(self):
            raise SparseExtendUnsupported(f"{name}: this backend configuration cannot split")
        if diff.build is None:
            result, path = init_metadata(self, view), SparsePath.SPLIT_VIEW
        else:
            result, path = diff.build(init_metadata, self, forward_batch, view)
        split = path is SparsePath.SPLIT_VIEW
        built = split_view_of(forward_batch).sequences if split else self.forward_metadata
        setattr(self, BUILT_ATTR, built)
        count_sparse_batch(path, forward_batch)
        return result

    def init_out_graph_hook(self: Any, forward_batch: Any, *args: Any, **kw: Any) -> Any:
        if not graph_can_carry(forward_batch):
            raise SparseExtendUnsupported(f"{name}: sparse extend under a CUDA graph")
        return init_out_graph(self, forward_batch, *args, **kw)

    def forward_extend_hook(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        view = split_batch(name, forward_batch)
        if view is None:
            return forward_extend(self, q, k, v, layer, forward_batch, *args, **kw)
        check_causal_layer(name, layer)
        batch = view if diff.extend is None else diff.extend(self, forward_batch, view, kw)
        return forward_extend(self, q, k, v, layer, batch, *args, **kw)

    wrappers: Wrappers = {
        (cls, "init_forward_metadata"): init_forward_metadata_hook,
        (cls, "init_forward_metadata_out_graph"): init_out_graph_hook,
        (cls, "forward_extend"): forward_extend_hook,
    }
    return {**wrappers, **(diff.extra(cls) if diff.extra else {})}
