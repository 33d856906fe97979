"""What a prepared prefill batch carries for its sparse requests until its forward
(:class:`BatchReuse`, on the ScheduleBatch): each sparse request's true positions and the check
layer's candidates. The span copy (:mod:`.span_copy`) writes it; ``ForwardBatch.init_new``
(:func:`forward_positions`), the check layer, the CUDA-graph vote and the KV canary recorder
read it; the adapter clears it before the batch is prepared again. Reads nothing of sglang but
the batch's ``reqs``, ``extend_lens`` and ``prefix_lens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from semblend_sglang.config import Config

BATCH_ATTR = "_semblend_batch"
"""ScheduleBatch attribute: its :class:`BatchReuse` (None, or absent, for a batch with none)."""


@dataclass(frozen=True)
class CheckCandidates:
    """One request's copied positions in a batch that selects at the check layer: ``offsets``
    into the request's computed tokens of this chunk (CPU int64, ascending) of the positions
    scored there (all copied positions, or their :func:`~semblend_sglang.recompute.check_sample`);
    ``final``: the chunk ends the prompt (the outcome is recorded at the check); ``reused``:
    every position the request copied in this chunk (the budget's base); ``pinned``: offsets of
    copied positions left out of the sample that a dense reference still computes (their K/V
    forced to the donor's in every layer; empty otherwise); ``spans``: the plan's spans (whether
    a second check applies); ``settings``: the request's repair settings (None: the
    server's)."""

    offsets: torch.Tensor
    final: bool
    reused: int
    pinned: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    spans: int = 1
    settings: Config | None = None


@dataclass
class BatchReuse:
    """What one prepared batch carries for its sparse requests until its forward:
    ``sparse``: {rid: true positions of its computed tokens (CPU int64)};
    ``candidates``: {rid: :class:`CheckCandidates`} of the requests selected at the check
    layer (:mod:`.check_layer`)."""

    sparse: dict[str, torch.Tensor] = field(default_factory=dict)
    candidates: dict[str, CheckCandidates] = field(default_factory=dict)


def batch_reuse(batch: Any) -> BatchReuse | None:
    """``batch``'s :class:`BatchReuse`, or None when it has none."""
    return getattr(batch, BATCH_ATTR, None)


def own_batch_reuse(batch: Any) -> BatchReuse:
    """``batch``'s :class:`BatchReuse`, set on it empty first when it has none: the span copy
    calls it when it makes a request sparse or selects one at the check layer."""
    found = batch_reuse(batch)
    if found is None:
        found = BatchReuse()
        setattr(batch, BATCH_ATTR, found)
    return found


def forward_positions(batch: Any, positions: torch.Tensor) -> torch.Tensor | None:
    """The true positions of ``batch``'s computed tokens when it holds sparse requests (None
    otherwise): a sparse request's kept positions, ``arange(prefix, prefix + extend)`` for any
    other request (decode rows mixed in included). ``positions`` is what sglang computed; the
    result has its length, dtype and device. Raises ValueError when the batch's lengths and
    ``positions`` disagree."""
    found = batch_reuse(batch)
    sparse = None if found is None else found.sparse
    if not sparse:
        return None
    parts: list[torch.Tensor] = []
    for i, req in enumerate(batch.reqs):
        mine = sparse.get(req.rid)
        ext = int(batch.extend_lens[i])
        if mine is not None and int(mine.numel()) == ext:
            parts.append(mine)
        else:
            pre = int(batch.prefix_lens[i])
            parts.append(torch.arange(pre, pre + ext, dtype=torch.int64))
    out = torch.cat(parts)
    if out.numel() != positions.numel():
        raise ValueError(
            f"sparse positions ({out.numel()}) and the batch's tokens ({positions.numel()}) differ"
        )
    return out.to(device=positions.device, dtype=positions.dtype, non_blocking=True)


def clear(batch: Any) -> None:
    """Forget ``batch``'s sparse positions and check candidates (it is about to be prepared for
    another step, or its forward is a decode)."""
    if batch_reuse(batch) is not None:
        setattr(batch, BATCH_ATTR, None)
