"""Restricting a running forward to some of its rows, between two decoder layers: the layer's
output (:func:`shrink_hidden`), the ``ForwardBatch``'s per-token and per-request fields
(:func:`shrink_batch`), and the attention backend whose metadata must then be rebuilt
(:func:`attention_backend`). Called by :mod:`.check_layer` after the check layer, on the
scheduler's forward thread; sglang-version facts (the residual handle, the forward context) live
here.
"""

from __future__ import annotations

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
