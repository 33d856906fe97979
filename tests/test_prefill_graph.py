"""A batch holding a sparse request never replays sglang 0.5.23's prefill CUDA graph (on by
default on CUDA, whose out-of-graph metadata cannot carry the split view): the runner's
``can_run_graph`` says no for it and, under DP attention, this rank votes no at schedule time so
every rank runs that step eagerly; ordinary batches keep SGLang's answer. The hooks wrap the
real ``PrefillCudaGraphRunner`` and ``dp_attn`` module when the adapter is installed."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from semblend_sglang.config import Config
from semblend_sglang.patches.sglang.attention.split_view import is_sparse_batch
from tests.harness.attention_backend import forward_batch
from tests.harness.reuse import installed
from tests.sparse_extend_batches import random_batch

pytest.importorskip("sglang")


def _runner_answering(answer: bool) -> type:
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        PrefillCudaGraphRunner,
    )

    class Runner(PrefillCudaGraphRunner):
        """The real runner class with SGLang's own check answering ``answer``."""

        def can_run_graph(self, forward_batch: Any) -> bool:
            return answer

    return Runner


def _votes(vote: Callable[..., bool]) -> ModuleType:
    """A module holding ``_local_prefill_cuda_graph_vote`` as dp_attn does."""
    module = ModuleType("dp_attn_votes")
    module._local_prefill_cuda_graph_vote = vote  # type: ignore[attr-defined]
    return module


def test_a_sparse_batch_runs_eagerly_an_ordinary_one_keeps_sglangs_answer():
    from semblend_sglang.patches.sglang.engine.unified import prefill_graph_wrappers

    sparse = forward_batch(random_batch(1, n_requests=2, kinds=("sparse", "cold")))
    ordinary = forward_batch(random_batch(1, n_requests=2, kinds=("exact", "cold")))
    assert is_sparse_batch(sparse) and not is_sparse_batch(ordinary)
    for answer in (True, False):
        runner = _runner_answering(answer)
        hooks = prefill_graph_wrappers(runner, _votes(lambda **kw: True))
        can_run = hooks[(runner, "can_run_graph")]
        instance = object.__new__(runner)
        assert can_run(instance, sparse) is False
        assert can_run(instance, ordinary) is answer


def test_dp_vote_is_no_for_a_schedule_batch_with_a_sparse_request():
    from semblend_sglang.patches.sglang.engine.unified import prefill_graph_wrappers
    from semblend_sglang.patches.sglang.flow import batch_state

    seen: list[Any] = []

    def vote(**kw: Any) -> bool:
        seen.append(kw["local_batch"])
        return True

    module = _votes(vote)
    hooks = prefill_graph_wrappers(_runner_answering(True), module)
    vote_hook = hooks[(module, "_local_prefill_cuda_graph_vote")]
    plain, sparse = SimpleNamespace(), SimpleNamespace()
    setattr(sparse, batch_state.BATCH_ATTR, batch_state.BatchReuse(sparse={"r": torch.arange(3)}))
    exact_only = SimpleNamespace()
    setattr(exact_only, batch_state.BATCH_ATTR, batch_state.BatchReuse())
    assert vote_hook(local_batch=sparse, num_tokens=8) is False
    assert vote_hook(local_batch=plain, num_tokens=8) is True
    assert vote_hook(local_batch=exact_only, num_tokens=8) is True
    assert vote_hook(local_batch=None, num_tokens=0) is True
    assert seen == [plain, exact_only, None]  # SGLang's vote decides every other batch


def test_the_adapter_wraps_the_real_runner_and_vote_and_restores_them():
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        PrefillCudaGraphRunner,
    )

    from tests.harness.versions import contract_part

    if not contract_part().computed_admission:
        pytest.skip("the prefill CUDA graph hooks belong to sglang 0.5.23's adapter")
    can_run, vote = PrefillCudaGraphRunner.can_run_graph, dp_attn._local_prefill_cuda_graph_vote
    gen = installed(Config())
    next(gen)
    try:
        assert PrefillCudaGraphRunner.can_run_graph is not can_run
        assert PrefillCudaGraphRunner.can_run_graph.__wrapped__ is can_run
        assert dp_attn._local_prefill_cuda_graph_vote.__wrapped__ is vote
        sparse = forward_batch(random_batch(1, n_requests=2, kinds=("sparse", "cold")))
        assert is_sparse_batch(sparse)
        runner = object.__new__(PrefillCudaGraphRunner)  # SGLang's check would need its state
        assert PrefillCudaGraphRunner.can_run_graph(runner, sparse) is False
    finally:
        gen.close()
    assert PrefillCudaGraphRunner.can_run_graph is can_run
    assert dp_attn._local_prefill_cuda_graph_vote is vote
