"""Agreement of one prefill batch's copy outcome across the ranks that run that batch together.

With tensor (or context) parallel attention every rank's scheduler builds the same batch and runs
its own copy of semblend. A failure on one rank only (a kernel out of memory, a config read, an
embedder that did not load, a lookup error) would make that rank compute positions its peers
copied; the ranks would then run extends of different shapes into the same collectives and hang.
So, after each rank copied what it could and before any rank changes its batch, the ranks agree:
a position counts as reused only where *every* rank copied it (an all-reduce MIN over the batch's
extend tokens, on the CPU groups SGLang's own cache uses for its cross-rank decisions). Positions
some rank did not copy are computed everywhere; the KV a rank copied there is overwritten by the
forward, since the slots are the request's own fresh ones.

Called by :func:`.span_copy.load_batch_spans` on every prefill batch when the batch has peers,
whether or not this rank planned anything, so that every rank calls the same collectives in the
same order. Never called for a batch without peers (one rank, or data-parallel attention with one
rank per attention group). The admission of a sparse request (what SGLang's ``PrefillAdder`` is
charged, which decides where its chunk ends) is agreed the same way (:func:`agree_min`), on every
admission call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

_warned_shape = False


def attention_peers(cache: Any) -> list[Any]:
    """The CPU process groups of the ranks that run ``cache``'s batches with it, for sglang
    0.5.22+ (``UnifiedRadixCache.attn_cp_group`` / ``attn_tp_group``, set from SGLang's
    ``CacheInitParams``): each group with more than one rank. Empty without torch.distributed."""
    return _groups_with_peers(
        getattr(cache, name, None) for name in ("attn_cp_group", "attn_tp_group")
    )


def _groups_with_peers(groups: Any) -> list[Any]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return []
    return [g for g in groups if g is not None and dist.get_world_size(group=g) > 1]


def global_attention_peers(_cache: Any) -> list[Any]:
    """The same for sglang versions whose cache holds no group (0.5.15 - 0.5.18): the process's
    attention tensor-parallel CPU group from ``sglang.srt.layers.dp_attention``, when the model
    runner initialized it."""
    try:
        from sglang.srt.layers.dp_attention import get_attention_tp_group

        group = get_attention_tp_group()
    except (ImportError, AssertionError, AttributeError):
        return []
    return _groups_with_peers([getattr(group, "cpu_group", None)])


def _all_reduce(groups: Sequence[Any], tensor: torch.Tensor, op: Any) -> None:
    import torch.distributed as dist

    for group in groups:
        dist.all_reduce(tensor, op=op, group=group)


def agree_min(groups: Sequence[Any], value: int) -> int:
    """The smallest of every rank's ``value`` (an all-reduce MIN over ``groups``); every rank of
    the groups must call it, in the same order."""
    import torch.distributed as dist

    tensor = torch.tensor([int(value)], dtype=torch.int64)
    _all_reduce(groups, tensor, dist.ReduceOp.MIN)
    return int(tensor[0])


def agree_on_copied(groups: Sequence[Any], copied: torch.Tensor, any_planned: bool) -> torch.Tensor:
    """The positions every rank of ``groups`` copied: ``copied`` (bool, one entry per extend
    token of the batch, on the CPU) MIN-reduced over the groups. One collective when no rank
    planned anything (the result is then all False), two otherwise. When the ranks' batches do
    not have the same number of extend tokens (they should never differ), nothing counts as
    copied on any rank, logged once."""
    global _warned_shape
    import torch.distributed as dist

    n = int(copied.numel())
    header = torch.tensor([n, -n, int(any_planned)], dtype=torch.int64)
    _all_reduce(groups, header, dist.ReduceOp.MAX)
    none = torch.zeros(n, dtype=torch.bool)
    if int(header[2]) == 0:
        return none
    if int(header[0]) != -int(header[1]):
        if not _warned_shape:
            _warned_shape = True
            logger.error(
                "semblend: ranks built prefill batches of %d to %d extend tokens; no reuse "
                "for such batches",
                -int(header[1]),
                int(header[0]),
            )
        return none
    agreed = copied.to(torch.uint8)
    _all_reduce(groups, agreed, dist.ReduceOp.MIN)
    return agreed.bool()
