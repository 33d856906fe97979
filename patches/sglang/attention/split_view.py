"""The split view: a batch holding a sparse request as an ordinary extend, and why it is exact.

A sparse request (``extend_prefix_len + extend_seq_len != seq_len``) computes the positions in
``forward_batch.positions`` (ascending); every other position below its last computed one holds
reused KV already in the pool. Its computed positions form maximal runs ``[s_1, e_1), [s_2, e_2),
...``. A query at position ``p`` in run ``j`` must see every key at position ``<= p``: exactly
what every backend computes for an ordinary request with prefix ``s_j`` and extend ``e_j - s_j``.
So the view lists each run as its own extend sequence (the request's ``req_to_token`` row, prefix
``s_j``, extend ``e_j - s_j``, sequence length ``e_j``); ordinary requests appear once, unchanged.
Tokens stay in order, so ``positions``, ``out_cache_loc`` and the q/k/v rows are unchanged. Only
attention metadata and the attention call see the view; logits, sampling, the scheduler and the
cache keep the real :class:`ForwardBatch`. The view is valid only where the backend writes this
pass's KV before it reads a run's prefix (runs after the first read earlier runs' computed KV as
prefix): each backend's module says so for its kernel.

The attention hooks built on it are :mod:`.hook_kit`'s. Nothing here changes SGLang or the
batch it is given.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..batch_fields import set_view_lengths

NOTES_ATTR = "_semblend_notes"
"""The one attribute semblend sets on a ForwardBatch: its :class:`ForwardNotes`."""

LEN_FIELDS = (
    "positions",
    "extend_prefix_lens",
    "extend_prefix_lens_cpu",
    "extend_seq_lens",
    "extend_seq_lens_cpu",
    "seq_lens",
    "seq_lens_cpu",
)
"""The ForwardBatch fields a batch's split is computed from. SGLang and the check layer replace
them rather than edit them, so a kept answer is valid while each field is the same object."""


@dataclass(frozen=True)
class SplitSequences:
    """The view's per-sequence fields: for each sub-sequence its request's index in the real
    batch, prefix length, extend length and sequence length (prefix + extend)."""

    request: list[int]
    prefix: list[int]
    extend: list[int]
    seq: list[int]


@dataclass(frozen=True)
class SplitView:
    """A batch's split view: ``batch`` is the ForwardBatch copy the backend is given (None when
    the real batch holds no sparse request), ``sequences`` its per-sequence fields."""

    batch: Any
    sequences: SplitSequences | None


def _cpu_list(values: Any, tensor: Any) -> list[int] | None:
    if values is not None:
        return [int(x) for x in values]
    if tensor is not None:
        return [int(x) for x in tensor.tolist()]
    return None


def batch_lens(forward_batch: Any) -> tuple[list[int], list[int], list[int]] | None:
    """(prefix lengths, extend lengths, sequence lengths) of an extend batch, on the host; None
    when a field is missing (decode, idle)."""
    prefix = _cpu_list(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
    extend = _cpu_list(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
    seq = _cpu_list(None, getattr(forward_batch, "seq_lens_cpu", None))
    if seq is None and forward_batch.seq_lens is not None:
        seq = [int(x) for x in forward_batch.seq_lens.tolist()]
    if prefix is None or extend is None or seq is None:
        return None
    return prefix, extend, seq


def _fields(forward_batch: Any) -> tuple[Any, ...]:
    return tuple(getattr(forward_batch, name, None) for name in LEN_FIELDS)


@dataclass
class BatchNotes:
    """What the attention hooks learn about one ForwardBatch for its current :data:`LEN_FIELDS`
    objects, so every layer asks once: whether it is sparse, its split view and its computed
    tokens' positions (torch_native)."""

    fields: tuple[Any, ...]
    sparse: bool | None = None
    view: SplitView | None = None
    positions: tuple[torch.Tensor, bool] | None = None


@dataclass
class ForwardNotes:
    """Everything semblend keeps on one ForwardBatch during its forward (:data:`NOTES_ATTR`):
    the attention hooks' :class:`BatchNotes` (new ones once the check layer shrinks the batch),
    whether it was counted on a sparse path, the check layer's state (check_layer.py's) and the
    KV canary's (kv_canary_record.py's); None unless set. Only :func:`forward_notes` makes one."""

    batch: BatchNotes
    counted: bool = False
    check: object | None = None
    canary: object | None = None


def forward_notes(forward_batch: Any) -> ForwardNotes:
    """The batch's :class:`ForwardNotes`, made on first use, their ``batch`` renewed once one of
    its :data:`LEN_FIELDS` objects was replaced; unkept ones for a batch that takes no
    attributes. Called by the hooks and the check layer, never by SGLang."""
    now = _fields(forward_batch)
    notes = getattr(forward_batch, NOTES_ATTR, None)
    if notes is None:
        notes = ForwardNotes(BatchNotes(now))
        with contextlib.suppress(AttributeError):
            setattr(forward_batch, NOTES_ATTR, notes)
    elif not all(a is b for a, b in zip(notes.batch.fields, now, strict=True)):
        notes.batch = BatchNotes(now)
    return notes


def notes_of(forward_batch: Any) -> BatchNotes:
    """The attention hooks' notes for the batch's current :data:`LEN_FIELDS` objects."""
    return forward_notes(forward_batch).batch


def check_of(forward_batch: Any) -> object | None:
    """The check layer's state on the batch, None when it set none; never makes notes."""
    notes = getattr(forward_batch, NOTES_ATTR, None)
    return None if notes is None else notes.check


def is_sparse_batch(forward_batch: Any) -> bool:
    """True when an extend batch holds a request with ``prefix_len + extend_len != seq_len``;
    False for any batch without those fields (decode, idle). Kept in the batch's notes, so the
    host reads of :func:`batch_lens` happen once per forward, not once per layer."""
    if not forward_batch.forward_mode.is_extend():
        return False
    notes = notes_of(forward_batch)
    if notes.sparse is None:
        lens = batch_lens(forward_batch)
        notes.sparse = lens is not None and any(m + c != n for m, c, n in zip(*lens, strict=True))
    return notes.sparse


def computed_runs(positions: torch.Tensor | list[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[s, e)`` of ascending ``positions`` (a 1-D tensor or a list), found with
    tensor ops (one host copy of the run bounds). Raises ValueError when they are not strictly
    ascending."""
    pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    if pos.numel() == 0:
        return []
    step = pos[1:] - pos[:-1]
    if bool((step <= 0).any()):
        at = int(pos[1:][step <= 0][0])
        raise ValueError(f"positions not strictly ascending at {at}")
    breaks = torch.nonzero(step != 1).reshape(-1) + 1
    zero = torch.zeros(1, dtype=torch.int64, device=pos.device)
    end = torch.full((1,), pos.numel(), dtype=torch.int64, device=pos.device)
    first = torch.cat([zero, breaks.to(pos.device)])
    last = torch.cat([breaks.to(pos.device), end]) - 1
    bounds = torch.stack([pos[first], pos[last] + 1], dim=1).tolist()
    return [(int(a), int(b)) for a, b in bounds]


def split_sequences(forward_batch: Any) -> SplitSequences | None:
    """The per-sequence fields of the view of ``forward_batch``; None when it holds no sparse
    request or its lengths are unknown. Raises ValueError when a sparse request's positions are
    missing, not 1-D, of the wrong count, not ascending, or reach past its sequence length."""
    lens = batch_lens(forward_batch)
    if lens is None:
        return None
    prefix, extend, seq = lens
    if all(m + c == n for m, c, n in zip(prefix, extend, seq, strict=True)):
        return None
    positions = forward_batch.positions
    if positions is None or positions.dim() != 1 or positions.shape[0] != sum(extend):
        raise ValueError("a sparse request needs one position per computed token")
    out = SplitSequences([], [], [], [])
    start = 0
    for i, (m, c, n) in enumerate(zip(prefix, extend, seq, strict=True)):
        if m + c == n:
            runs = [(m, n)]
        else:
            runs = computed_runs(positions[start : start + c])
            if runs and (runs[0][0] < m or runs[-1][1] > n):
                raise ValueError(f"request {i}: computed positions outside [{m}, {n})")
        for s, e in runs:
            out.request.append(i)
            out.prefix.append(s)
            out.extend.append(e - s)
            out.seq.append(e)
        start += c
    return out


def build_view(forward_batch: Any, seqs: SplitSequences) -> Any:
    """A shallow copy of ``forward_batch`` whose per-sequence fields are ``seqs``' (rows
    repeated per run, prefix/extend/sequence lengths, start offsets, sums:
    :func:`.batch_fields.set_view_lengths`); every other field is the real batch's object."""
    view = copy.copy(forward_batch)
    view.__dict__.pop(NOTES_ATTR, None)  # the real batch's notes, copied along
    set_view_lengths(view, forward_batch, seqs.request, seqs.seq, seqs.extend, seqs.prefix)
    return view


def split_view_of(forward_batch: Any) -> SplitView:
    """The batch's :class:`SplitView`, built once per ForwardBatch object and kept in its notes
    (:func:`notes_of`); rebuilt when one of its :data:`LEN_FIELDS` was replaced (the check
    layer shrinking the batch). ``batch`` is None for a batch without a sparse request (the
    backend gets the real batch). Raises ValueError as :func:`split_sequences`."""
    notes = notes_of(forward_batch)
    if notes.view is None:
        seqs = split_sequences(forward_batch) if forward_batch.forward_mode.is_extend() else None
        notes.view = SplitView(None if seqs is None else build_view(forward_batch, seqs), seqs)
    return notes.view
