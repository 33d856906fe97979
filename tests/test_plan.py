"""Planner gates: prompt length, exact coverage, sinks, pages, last token, max spans, reuse."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semblend_sglang.align import Span, align
from semblend_sglang.config import Config
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import (
    Decision,
    DecisionKind,
    Reason,
    build_plan,
    cover,
    prefilter,
    trim_spans,
)

NS = Namespace("m")


def plan(config: Config, spans: tuple[Span, ...], n: int, exact_len: int = 0, page: int = 1):
    return build_plan(
        config,
        spans=spans,
        n_tokens=n,
        exact_len=exact_len,
        page_size=page,
        donor_handle="d",
        donor_namespace=NS,
    )


def test_prefilter_gates() -> None:
    assert prefilter(Config(enabled=False), 5000, 0).reason == Reason.DISABLED
    assert prefilter(Config(), 255, 0).reason == Reason.PROMPT_TOO_SHORT
    assert prefilter(Config(), 1000, 900).kind == "exact"
    assert prefilter(Config(), 1000, 1000).kind == "exact"
    assert prefilter(Config(exact_sufficient_ratio=1.0), 1000, 999) is None
    assert prefilter(Config(), 1000, 0) is None


def test_a_decision_carries_a_plan_iff_it_is_a_plan() -> None:
    planned = plan(Config(min_prompt_tokens=64), (Span(0, 0, 900),), 1000)
    assert planned.kind is DecisionKind.PLAN and planned.plan is not None
    assert planned.kind == "plan"  # a StrEnum: compares equal to its value
    assert Decision("plan", Reason.PLANNED, planned.plan).kind is DecisionKind.PLAN
    with pytest.raises(ValueError, match="a plan decision needs a plan"):
        Decision(DecisionKind.PLAN, Reason.PLANNED)
    with pytest.raises(ValueError, match="may not carry a plan"):
        Decision(DecisionKind.DECLINE, Reason.NO_DONOR, planned.plan)
    with pytest.raises(ValueError):
        Decision("maybe", Reason.NO_DONOR)  # type: ignore[arg-type]
    evidence = Decision.decline(Reason.DISCOVERY_ONLY, evidence=planned.plan)
    assert evidence.kind is DecisionKind.DECLINE and evidence.plan is None
    assert evidence.evidence is planned.plan


def test_sink_page_alignment_and_last_token() -> None:
    spans = (Span(10, 110, 300), Span(400, 0, 600))
    trimmed = trim_spans(spans, n_tokens=1000, exact_len=0, page_size=16, sink_tokens=4)
    # 10+4 -> 16; end 310 -> 304; donor moves by the same amount
    assert trimmed[0] == Span(16, 116, 288)
    # 400+4 -> 416; end min(1000, last page boundary before n-1=999 -> 992)
    assert trimmed[1] == Span(416, 16, 992 - 416)
    for s in trimmed:
        assert s.target_start % 16 == 0 and s.target_end % 16 == 0
        assert s.target_end <= 999
    assert trimmed[0].delta == spans[0].delta


def test_first_span_starts_at_or_after_exact_len() -> None:
    trimmed = trim_spans(
        (Span(0, 0, 800),), n_tokens=1000, exact_len=256, page_size=1, sink_tokens=0
    )
    assert trimmed == (Span(256, 256, 544),)


def test_max_spans_and_strict_prefix_boundary() -> None:
    spans = tuple(Span(100 + 300 * i, 5000 + 200 * i, 150 + i) for i in range(6))
    strict = plan(
        Config(strict_prefix_boundary=True, min_reuse_tokens=1, min_reuse_ratio=0.0, sink_tokens=0),
        spans,
        2000,
    )
    assert strict.kind == "plan" and strict.plan is not None
    assert strict.plan.spans == (Span(1600, 6000, 155),)  # the longest one
    loose = plan(
        Config(
            strict_prefix_boundary=False,
            max_spans=3,
            min_reuse_tokens=1,
            min_reuse_ratio=0.0,
            sink_tokens=0,
        ),
        spans,
        2000,
    )
    assert loose.plan is not None
    assert [s.length for s in loose.plan.spans] == [153, 154, 155]
    assert loose.plan.reused_tokens == 153 + 154 + 155
    assert list(loose.plan.spans) == sorted(loose.plan.spans)


def test_reuse_gates() -> None:
    spans = (Span(500, 0, 100),)
    assert plan(Config(), (), 1000).reason == Reason.NO_ALIGNMENT
    assert plan(Config(), (Span(998, 0, 2),), 1000).reason == Reason.SPANS_TRIMMED_AWAY
    assert plan(Config(), spans, 1000).reason == Reason.REUSE_TOO_SMALL
    assert plan(Config(min_reuse_tokens=50), spans, 1000).reason == Reason.REUSE_RATIO_LOW
    ok = plan(Config(min_reuse_tokens=50, min_reuse_ratio=0.05), spans, 1000)
    assert ok.kind == "plan" and ok.plan is not None
    assert ok.plan.reused_tokens == 96 and ok.plan.first_reused == 504
    assert abs(ok.plan.reuse_ratio - 0.096) < 1e-9


@st.composite
def aligned_case(draw):  # type: ignore[no-untyped-def]
    tokens = st.integers(0, 3)
    target = draw(st.lists(tokens, min_size=4, max_size=120))
    donor = draw(st.lists(tokens, max_size=120))
    if draw(st.booleans()):
        a = draw(st.integers(0, len(target) - 1))
        donor = donor + target[a:]
    exact_len = draw(st.integers(0, len(target) - 1))
    page = draw(st.sampled_from([1, 2, 4, 16]))
    sink = draw(st.integers(0, 5))
    max_spans = draw(st.integers(1, 4))
    return target, donor, exact_len, page, sink, max_spans


@settings(max_examples=200, deadline=None)
@given(aligned_case())
def test_plan_invariants(case) -> None:  # type: ignore[no-untyped-def]
    target, donor, exact_len, page, sink, max_spans = case
    t = np.asarray(target, dtype=np.int64)
    d = np.asarray(donor, dtype=np.int64)
    region = align(t[exact_len:], d, min_length=3)
    spans = tuple(Span(s.target_start + exact_len, s.donor_start, s.length) for s in region)
    config = Config(
        min_prompt_tokens=0,
        min_reuse_tokens=1,
        min_reuse_ratio=0.0,
        sink_tokens=sink,
        max_spans=max_spans,
        strict_prefix_boundary=False,
        min_span_tokens=3,
    )
    decision = plan(config, spans, t.size, exact_len, page)
    if decision.kind != "plan":
        return
    p = decision.plan
    assert p is not None and 1 <= len(p.spans) <= max_spans
    assert p.reused_tokens == sum(s.length for s in p.spans)
    prev_t = prev_d = -1
    for s in sorted(p.spans, key=lambda s: s.donor_start):
        assert s.donor_start >= prev_d
        prev_d = s.donor_end
    for s in p.spans:
        assert s.target_start >= exact_len + sink
        assert s.target_start % page == 0 and s.target_end % page == 0
        assert s.target_end <= t.size - 1
        assert s.target_start >= prev_t
        prev_t = s.target_end
        assert np.array_equal(t[s.target_start : s.target_end], d[s.donor_start : s.donor_end])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 900), st.integers(0, 900), st.integers(1, 200)),
            max_size=6,
        ),
        max_size=5,
    ),
    st.integers(1, 64),
)
def test_cover_takes_disjoint_pieces_of_the_given_spans(
    raw: list[list[tuple[int, int, int]]], min_length: int
) -> None:
    found = [(f"d{k}", tuple(Span(t, d, n) for t, d, n in spans)) for k, spans in enumerate(raw)]
    spans, donors = cover(found, min_length=min_length)
    assert len(spans) == len(donors)
    for a, b in itertools.pairwise(spans):
        assert a.target_end <= b.target_start  # sorted, disjoint in the target
    given_by_donor = dict(found)
    for piece, donor in zip(spans, donors, strict=True):
        assert piece.length >= min_length
        # each piece lies inside one of its donor's spans, on that span's diagonal
        assert any(
            s.target_start <= piece.target_start
            and piece.target_end <= s.target_end
            and piece.delta == s.delta
            for s in given_by_donor[donor]
        )
    # the longest given span (ties: earlier donor) is always taken whole
    every = [(s, k) for k, (_, ss) in enumerate(found) for s in ss if s.length >= min_length]
    if every:
        longest = min(every, key=lambda item: (-item[0].length, item[1], item[0].target_start))
        assert longest[0] in spans
