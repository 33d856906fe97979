"""Keep a batch holding a sparse request out of sglang 0.5.23's prefill CUDA graph.

On CUDA, SGLang replays prefill batches through ``PrefillCudaGraphRunner`` by default (the
breakable backend), whose attention metadata comes from ``init_forward_metadata_out_graph``
for the real batch (the rule: :func:`.split_hooks.graph_can_carry`). These wrappers make the
runner's ``can_run_graph`` say no for such a batch (the model runner then runs it eagerly,
through the hooked ``init_forward_metadata``), and, under DP attention, make this rank's vote
for the graph (``dp_attn._local_prefill_cuda_graph_vote``, min-reduced across ranks) no for a
batch with a sparse request, so every rank runs that step eagerly together. Ordinary batches keep
SGLang's answer. Installed by the 0.5.23 adapter's hook table; never raises on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import one_pass
from .split_hooks import graph_can_carry
from .wrapping import Wrappers


def _sparse_schedule_batch(batch: Any) -> bool:
    reuse = one_pass.batch_reuse(batch) if batch is not None else None
    return reuse is not None and bool(reuse.sparse)


def prefill_graph_wrappers(runner: type, dp_attn: Any) -> Wrappers:
    """Wrappers of ``runner.can_run_graph`` (``PrefillCudaGraphRunner``) and of the module
    function ``dp_attn._local_prefill_cuda_graph_vote``, built from the current originals."""
    can_run_graph = runner.can_run_graph
    vote: Callable[..., bool] = dp_attn._local_prefill_cuda_graph_vote

    def can_run_graph_hook(self: Any, forward_batch: Any) -> bool:
        return graph_can_carry(forward_batch) and can_run_graph(self, forward_batch)

    def vote_hook(*args: Any, **kwargs: Any) -> bool:
        if _sparse_schedule_batch(kwargs.get("local_batch")):
            return False
        return vote(*args, **kwargs)

    return {
        (runner, "can_run_graph"): can_run_graph_hook,
        (dp_attn, "_local_prefill_cuda_graph_vote"): vote_hook,
    }
