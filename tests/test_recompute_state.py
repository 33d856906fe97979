"""A request's recompute bookkeeping in the runtime: span heads, check-layer reports, outcomes.

Plans come from the real provider (a registered donor and a lookup); the engine side is the
runtime's transitions the one-pass load and the check layer call.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from semblend_sglang.config import Config
from semblend_sglang.namespace import Namespace
from semblend_sglang.patches.sglang.request_reuse import ReuseState
from semblend_sglang.patches.sglang.runtime import RequestReuse, SemblendRuntime
from semblend_sglang.plan import Reason

NS = Namespace(model="test-model")
DOC = list(range(1000, 1700))
CONFIG = Config(min_prompt_tokens=64, min_reuse_tokens=32)


def _runtime(**settings: object) -> SemblendRuntime:
    return SemblendRuntime(replace(CONFIG, **settings), registry=CollectorRegistry())


def _start(runtime: SemblendRuntime, rid: str = "r") -> RequestReuse:
    runtime.register_donor(NS, "donor", [1, 2, 3, *DOC[:300], 4, 5, *DOC[300:]])
    decision = runtime.lookup(NS, [7, 8, 9, 10, 11, *DOC, 6], 0, rid, page_size=1)
    assert decision.plan is not None, decision
    return runtime.start(rid, NS, decision.plan)


def _declined(runtime: SemblendRuntime) -> dict[str, int]:
    return dict(runtime.snapshot().get("declined", {}))


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3])
def test_heads_skips_the_first_tokens_of_every_span_and_counts_them(ratio: float) -> None:
    runtime = _runtime(recompute_strategy="heads", recompute_ratio=ratio)
    state = _start(runtime)
    assert len(state.spans) == 2 and len(state.heads) == 2
    n = 5 + len(DOC) + 1
    pieces = state.pieces_within(0, n)
    for (piece, _), span, head in zip(pieces, state.spans, state.heads, strict=True):
        assert piece.target_start == span.target_start + head
        assert piece.target_end == span.target_end
    heads = state.heads_within(0, n)
    assert heads == sum(state.heads) >= ratio * sum(s.length for s in state.spans)
    state.loaded(pieces, n)
    assert state.recomputed == heads
    assert state.reused_total == sum(s.length for s in state.spans) - heads


def test_heads_counted_once_across_prefill_chunks() -> None:
    runtime = _runtime(recompute_strategy="heads", recompute_ratio=0.3)
    state = _start(runtime)
    cut = state.spans[1].target_start + 3  # inside the second span's head
    first = state.pieces_within(0, cut)
    state.loaded(first, cut)
    second = state.pieces_within(cut, 10_000)
    state.loaded(second, 10_000)
    assert state.recomputed == sum(state.heads)
    copied = sum(p.length for p, _ in first + second)
    assert copied + sum(state.heads) == sum(s.length for s in state.spans)


def test_check_layer_strategies_take_no_heads() -> None:
    for strategy in ("deviation", "query"):
        state = _start(_runtime(recompute_strategy=strategy, recompute_ratio=0.3))
        assert state.heads == ()


def test_a_checked_request_is_materialized_with_the_tokens_it_kept() -> None:
    runtime = _runtime()
    state = _start(runtime)
    pieces = state.pieces_within(0, 10_000)
    copied = sum(p.length for p, _ in pieces)
    state.loaded(pieces, 10_000)
    runtime.checked("r", 100, False, 0.01, final=True)
    assert state.state is ReuseState.MATERIALIZED
    snap = runtime.snapshot()
    assert snap["reused_tokens"] == copied - 100
    assert snap["recomputed_tokens"] == 100
    assert snap["recompute_checks"] == 1 and snap["recompute_gated"] == 0
    assert Reason.QUALITY_GATE not in _declined(runtime)


def test_a_gated_request_is_declined_as_quality_gate_and_keeps_its_publish_cap() -> None:
    runtime = _runtime(quality_gate=0.001)
    state = _start(runtime)
    pieces = state.pieces_within(0, 10_000)
    copied = sum(p.length for p, _ in pieces)
    state.loaded(pieces, 10_000)
    cap = state.publish_cap
    runtime.checked("r", copied, True, 0.5, final=True)
    assert _declined(runtime).get(Reason.QUALITY_GATE) == 1
    assert runtime.snapshot()["recompute_gated"] == 1
    assert runtime.snapshot()["outcomes"]["materialized"] == 0
    # what was copied is still approximate in the pool until overwritten: nothing from the
    # first copied position on is published
    assert state.reused_any and state.publish_cap == cap == pieces[0][0].target_start
    runtime.release("r")
    assert _declined(runtime).get(Reason.QUALITY_GATE) == 1  # one outcome per request


def test_a_check_on_a_non_final_chunk_waits_for_the_last_chunk() -> None:
    runtime = _runtime()
    state = _start(runtime)
    cut = state.spans[0].target_end
    first = state.pieces_within(0, cut)
    state.loaded(first, cut)
    runtime.checked("r", 10, False, 0.0, final=False)
    assert state.state is ReuseState.LOADING
    rest = state.pieces_within(cut, 10_000)
    state.loaded(rest, 10_000)
    runtime.checked("r", 20, False, 0.0, final=True)
    assert state.state is ReuseState.MATERIALIZED
    total = sum(p.length for p, _ in first + rest)
    assert runtime.snapshot()["reused_tokens"] == total - 30


def test_a_request_whose_forward_never_reported_is_settled_at_release() -> None:
    runtime = _runtime()
    state = _start(runtime)
    pieces = state.pieces_within(0, 10_000)
    state.loaded(pieces, 10_000)
    runtime.release("r")
    assert runtime.snapshot()["reused_tokens"] == sum(p.length for p, _ in pieces)
