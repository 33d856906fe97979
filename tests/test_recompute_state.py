"""A request's recompute bookkeeping in the request flow: span heads, check-layer reports,
outcomes.

Plans come from the real provider (a registered donor and a lookup); the engine side is the
transitions the one-pass load and the check layer call.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from semblend_sglang.config import Config
from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace
from semblend_sglang.patches.sglang.engine.unified import UnifiedRadixCacheAdapter
from semblend_sglang.patches.sglang.flow.request_flow import RequestFlow
from semblend_sglang.patches.sglang.flow.request_reuse import CheckOutcome, RequestReuse, ReuseState
from semblend_sglang.patches.sglang.runtime import SemblendRuntime
from semblend_sglang.plan import Reason

NS = Namespace(model="test-model")
DOC = list(range(1000, 1700))
CONFIG = Config(min_prompt_tokens=64, min_reuse_tokens=32)


def _flow(**settings: object) -> RequestFlow:
    """A request flow over its own metrics registry (the 0.5.23 adapter's view, never read)."""
    config = replace(CONFIG, **settings)
    view = UnifiedRadixCacheAdapter(config).flow.view
    return RequestFlow(config, SemblendRuntime(config, registry=CollectorRegistry()), view)


def _start(flow: RequestFlow, rid: str = "r") -> RequestReuse:
    runtime = flow.runtime
    flow.donors.register(NS, "donor", [1, 2, 3, *DOC[:300], 4, 5, *DOC[300:]])
    decision = runtime.lookup(LookupParams(NS, [7, 8, 9, 10, 11, *DOC, 6], 0, rid, page_size=1))
    assert decision.plan is not None, decision
    return flow.start(rid, NS, decision.plan)


def _declined(flow: RequestFlow) -> dict[str, int]:
    return dict(flow.runtime.snapshot().get("declined", {}))


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3])
def test_heads_skips_the_first_tokens_of_every_span_and_counts_them(ratio: float) -> None:
    flow = _flow(recompute_strategy="heads", recompute_ratio=ratio)
    state = _start(flow)
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
    flow = _flow(recompute_strategy="heads", recompute_ratio=0.3)
    state = _start(flow)
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
        state = _start(_flow(recompute_strategy=strategy, recompute_ratio=0.3))
        assert state.heads == ()


def test_a_checked_request_is_materialized_with_the_tokens_it_kept() -> None:
    flow = _flow()
    state = _start(flow)
    pieces = state.pieces_within(0, 10_000)
    copied = sum(p.length for p, _ in pieces)
    state.loaded(pieces, 10_000)
    flow.checked(CheckOutcome("r", 100, False, 0.01, final=True))
    assert state.state is ReuseState.MATERIALIZED
    snap = flow.runtime.snapshot()
    assert snap["reused_tokens"] == copied - 100
    assert snap["recomputed_tokens"] == 100
    assert snap["recompute_checks"] == 1 and snap["recompute_gated"] == 0
    assert Reason.QUALITY_GATE not in _declined(flow)


def test_a_gated_request_is_declined_as_quality_gate_and_keeps_its_publish_cap() -> None:
    flow = _flow(quality_gate=0.001)
    state = _start(flow)
    pieces = state.pieces_within(0, 10_000)
    copied = sum(p.length for p, _ in pieces)
    state.loaded(pieces, 10_000)
    cap = state.publish_cap
    flow.checked(CheckOutcome("r", copied, True, 0.5, final=True))
    assert _declined(flow).get(Reason.QUALITY_GATE) == 1
    assert flow.runtime.snapshot()["recompute_gated"] == 1
    assert flow.runtime.snapshot()["outcomes"]["materialized"] == 0
    # what was copied is still approximate in the pool until overwritten: nothing from the
    # first copied position on is published
    assert state.reused_any and state.publish_cap == cap == pieces[0][0].target_start
    flow.release("r")
    assert _declined(flow).get(Reason.QUALITY_GATE) == 1  # one outcome per request


def test_a_check_on_a_non_final_chunk_waits_for_the_last_chunk() -> None:
    flow = _flow()
    state = _start(flow)
    cut = state.spans[0].target_end
    first = state.pieces_within(0, cut)
    state.loaded(first, cut)
    flow.checked(CheckOutcome("r", 10, False, 0.0, final=False))
    assert state.state is ReuseState.LOADING
    rest = state.pieces_within(cut, 10_000)
    state.loaded(rest, 10_000)
    flow.checked(CheckOutcome("r", 20, False, 0.0, final=True))
    assert state.state is ReuseState.MATERIALIZED
    total = sum(p.length for p, _ in first + rest)
    assert flow.runtime.snapshot()["reused_tokens"] == total - 30


def test_a_request_whose_forward_never_reported_is_settled_at_release() -> None:
    flow = _flow()
    state = _start(flow)
    pieces = state.pieces_within(0, 10_000)
    state.loaded(pieces, 10_000)
    flow.release("r")
    assert flow.runtime.snapshot()["reused_tokens"] == sum(p.length for p, _ in pieces)
