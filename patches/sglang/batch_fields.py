"""Every write semblend makes to sglang's batch length fields, in one place: a prepared
``ScheduleBatch`` losing the copied positions from its computed tokens
(:func:`keep_scheduled_tokens`, called by the span copy), a running ``ForwardBatch`` restricted
to some of its rows between two decoder layers (:func:`shrink_batch`, with the layer's output,
:func:`shrink_hidden`, and the attention backend whose metadata must then be rebuilt,
:func:`attention_backend`; called by the check layer on the scheduler's forward thread), and the
split view's copy of a batch (:func:`set_view_lengths`, called by the split view; the real batch
is not written). sglang-version facts (the residual handle, the forward context) live here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch


def attention_backend(forward_batch: Any) -> Any | None:
    """The attention backend running ``forward_batch``'s forward, whose metadata the shrink
    rebuilds: sglang 0.5.22+ keeps it in the forward context (``get_attn_backend``), not on
    the batch; None when there is neither. A backend that builds its metadata once per forward
    (triton, fa3, flashinfer) would otherwise attend the shrunk rows with the full batch's."""
    try:
        from sglang.srt.model_executor import forward_context
    except ImportError:
        forward_context = None  # type: ignore[assignment]
    if forward_context is not None and forward_context.has_forward_context():
        return forward_context.get_attn_backend()
    return getattr(forward_batch, "attn_backend", None)


def shrink_hidden(out: Any, index: torch.Tensor, forward_batch: Any) -> Any:
    """``out`` (a decoder layer's output: a ``(hidden, residual, ...)`` tuple or sglang's
    residual-stream handle) restricted to the rows ``index``."""
    if isinstance(out, tuple):
        hidden, residual = out[0], out[1]
        return (hidden[index], None if residual is None else residual[index], *out[2:])
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    value = residual_batch.complete_output(out, forward_batch)
    handoff = residual_batch.export_replay_handoff(value, forward_batch)
    shrunk = residual_batch.ReplayHandoff(
        handoff.value[index],
        None if handoff.residual is None else handoff.residual[index],
        handoff.update,
        handoff.written,
    )
    return residual_batch.import_replay_handoff(shrunk, forward_batch)


def shrink_batch(
    forward_batch: Any,
    index: torch.Tensor,
    positions: torch.Tensor,
    old: tuple[int, ...],
    new: list[int],
) -> None:
    """Restrict the forward batch's per-token fields to ``index``; per-request lengths become
    ``new`` (from ``old``)."""
    fb = forward_batch
    total = sum(new)
    fb.positions = positions[index]
    fb.out_cache_loc = fb.out_cache_loc[index]
    if fb.input_ids is not None and int(fb.input_ids.shape[0]) == sum(old):
        fb.input_ids = fb.input_ids[index]
    device = fb.extend_seq_lens.device
    dtype = fb.extend_seq_lens.dtype
    fb.extend_seq_lens = torch.tensor(new, dtype=dtype, device=device)
    fb.extend_seq_lens_cpu = list(new)
    fb.extend_num_tokens = total
    if fb.extend_start_loc is not None:
        starts = torch.zeros(len(new), dtype=fb.extend_start_loc.dtype)
        if len(new) > 1:
            starts[1:] = torch.cumsum(torch.tensor(new[:-1]), 0)
        fb.extend_start_loc = starts.to(fb.extend_start_loc.device)
    if fb.extend_logprob_start_lens_cpu is not None:
        fb.extend_logprob_start_lens_cpu = [
            n - (o - s) for n, o, s in zip(new, old, fb.extend_logprob_start_lens_cpu, strict=True)
        ]
    for name in ("num_token_non_padded", "global_num_token_non_padded"):
        value = getattr(fb, name, None)
        if isinstance(value, torch.Tensor):
            value.fill_(total)
    if isinstance(getattr(fb, "global_num_token_non_padded_cpu", None), int):
        fb.global_num_token_non_padded_cpu = total


def keep_scheduled_tokens(batch: Any, keep: torch.Tensor, new: list[int]) -> None:
    """Restrict a prepared ScheduleBatch's computed tokens (``prefill_input_ids_cpu``,
    ``out_cache_loc``) to ``keep`` (one flag per computed token); per-request computed lengths
    become ``new`` (``extend_lens``, ``extend_num_tokens``), each request's logprob start kept at
    the same distance from its chunk's end. ``prefix_lens``, ``seq_lens`` and the rows stay."""
    old = [int(n) for n in batch.extend_lens]
    starts = batch.extend_logprob_start_lens
    for i, (n, o) in enumerate(zip(new, old, strict=True)):
        starts[i] = n - (o - int(starts[i]))
    ids = batch.prefill_input_ids_cpu
    new_ids = torch.empty(int(keep.sum()), dtype=ids.dtype, pin_memory=ids.is_pinned())
    torch.masked_select(ids, keep, out=new_ids)  # into pinned memory: the H2D copy stays async
    batch.prefill_input_ids_cpu = new_ids
    loc = batch.out_cache_loc
    batch.out_cache_loc = loc[keep.to(loc.device)]
    batch.extend_lens = list(new)
    batch.extend_num_tokens = sum(new)


def _like(values: Sequence[int], template: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(values), dtype=template.dtype, device=template.device)


def set_view_lengths(
    view: Any,
    forward_batch: Any,
    request: Sequence[int],
    seq: Sequence[int],
    extend: Sequence[int],
    prefix: Sequence[int],
) -> None:
    """Write on ``view`` (a shallow copy of ``forward_batch``) the per-sequence fields of the
    sequences given by ``request`` (each sequence's row index in the real batch) and their
    ``seq`` / ``extend`` / ``prefix`` lengths: rows, lengths, start offsets and sums. Fields the
    view cannot keep consistent (logprob starts, orig/max sequence-length overrides) become
    None. ``forward_batch`` is only read."""
    fb = forward_batch
    idx = torch.tensor(list(request), dtype=torch.int64, device=fb.req_pool_indices.device)
    view.batch_size = len(request)
    view.req_pool_indices = fb.req_pool_indices.index_select(0, idx)
    cpu_rows = getattr(fb, "req_pool_indices_cpu", None)
    if cpu_rows is not None:
        view.req_pool_indices_cpu = cpu_rows.index_select(0, idx.cpu())
    view.seq_lens = _like(seq, fb.seq_lens)
    if getattr(fb, "seq_lens_cpu", None) is not None:
        view.seq_lens_cpu = torch.tensor(list(seq), dtype=fb.seq_lens_cpu.dtype)
    view.seq_lens_sum = sum(seq)
    view.extend_seq_lens = _like(extend, fb.extend_seq_lens)
    view.extend_prefix_lens = _like(prefix, fb.extend_prefix_lens)
    view.extend_seq_lens_cpu = list(extend)
    view.extend_prefix_lens_cpu = list(prefix)
    starts = list(itertools.accumulate(list(extend)[:-1], initial=0))
    template = getattr(fb, "extend_start_loc", None)
    view.extend_start_loc = _like(starts, template if template is not None else fb.seq_lens)
    for name in ("extend_logprob_start_lens_cpu", "orig_seq_lens", "max_seq_len_override"):
        if hasattr(fb, name):
            setattr(view, name, None)
    if getattr(fb, "max_seq_len_host", None) is not None:
        view.max_seq_len_host = max(seq)
