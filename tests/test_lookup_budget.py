"""The lookup work budget (semblend_sglang/lookup_budget.py) and the provider on adversarial token
streams: property-based (hypothesis) over repeated tokens, periodic sequences and chunks shared by
many donors. Wall time is the bench's (``python -m semblend_sglang.bench adversarial``); here the
budget's work count, the determinism of decisions and the validity of plans are checked."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from semblend_sglang import provider as provider_module
from semblend_sglang.bench.adversarial import Stream, long_similar, periodic, repeated_token
from semblend_sglang.config import Config
from semblend_sglang.lookup_budget import (
    ANCHOR_PAIR_UNITS,
    DONOR_UNITS_PER_TOKEN,
    WORK_UNITS_PER_MS,
    AlignCharge,
    LookupBudget,
)
from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason
from semblend_sglang.provider import SemanticProvider

NS = Namespace(model="adversarial")


def test_charge_spends_only_what_fits() -> None:
    budget = LookupBudget(0.001)
    assert budget.total == WORK_UNITS_PER_MS // 1000
    assert budget.charge(budget.total - 1) and budget.remaining == 1
    assert not budget.charge(2) and budget.remaining == 1
    assert budget.charge(1) and budget.remaining == 0


def test_alignment_limits_shrink_with_what_is_left() -> None:
    budget = LookupBudget(1000.0)
    charge = budget.align_limits(1000, 1000, max_pairs=65536, max_diagonals=256)
    assert charge == AlignCharge(65536, 256, 1000)
    spent = budget.total - budget.remaining
    assert spent == DONOR_UNITS_PER_TOKEN * 1000 + 65536 * ANCHOR_PAIR_UNITS + 256 * 1000
    small = LookupBudget(0.1)  # donor k-grams first, then half of what is left for pairs
    left = small.total - DONOR_UNITS_PER_TOKEN * 1000
    fit = small.align_limits(1000, 1000, max_pairs=65536, max_diagonals=256)
    assert fit is not None
    assert fit.pairs == (left // 2) // ANCHOR_PAIR_UNITS and 1 <= fit.diagonals <= 256
    assert 0 <= small.remaining < 1000
    assert small.align_limits(1000, 1000, max_pairs=65536, max_diagonals=256) is None


def test_an_alignment_is_refunded_what_it_did_not_use_and_never_more() -> None:
    budget = LookupBudget(1000.0)
    charge = budget.align_limits(800, 1000, max_pairs=500, max_diagonals=20)
    assert charge == AlignCharge(500, 20, 800)
    after_charge = budget.remaining
    budget.refund_alignment(charge, pair_work=120, diagonals=3)
    assert budget.remaining - after_charge == 380 * ANCHOR_PAIR_UNITS + 17 * 800
    fully_used = budget.remaining
    budget.refund_alignment(charge, pair_work=10**9, diagonals=10**9)  # counts above the charge
    assert budget.remaining == fully_used
    budget.refund_alignment(charge, pair_work=-5, diagonals=-5)  # refunds at most the charge
    assert budget.remaining - fully_used == 500 * ANCHOR_PAIR_UNITS + 20 * 800


class _Recording(LookupBudget):
    """LookupBudget that keeps every instance, to read what each lookup spent."""

    made: ClassVar[list[LookupBudget]] = []

    def __init__(self, budget_ms: float) -> None:
        super().__init__(budget_ms)
        _Recording.made.append(self)


def _provider(stream: Stream, budget_ms: float) -> SemanticProvider:
    config = Config(
        lookup_budget_ms=budget_ms,
        min_prompt_tokens=64,
        min_reuse_tokens=32,
        max_donors=max(20000, len(stream.donors)),
    )
    provider = SemanticProvider(config, registry=CollectorRegistry())
    for handle, tokens in enumerate(stream.donors):
        provider.register(NS, handle, tokens)
    return provider


def _check_plan(stream: Stream, provider: SemanticProvider, decision: Any) -> None:
    """Every planned span is token-identical between the query and its donor."""
    if decision.kind != "plan":
        return
    plan = decision.plan
    for i, span in enumerate(plan.spans):
        donor = provider.donor_tokens(plan.donor_of(i))
        assert donor is not None
        got = stream.query[span.target_start : span.target_end]
        assert np.array_equal(got, donor[span.donor_start : span.donor_end])


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    kind = draw(st.sampled_from(["repeated", "periodic", "shared", "similar"]))
    n = draw(st.integers(min_value=256, max_value=12_000))
    seed = draw(st.integers(min_value=0, max_value=2**16))
    if kind == "repeated":
        return repeated_token(n, token=draw(st.integers(min_value=0, max_value=50_000)))
    if kind == "periodic":
        return periodic(n, period=draw(st.integers(min_value=1, max_value=64)), seed=seed)
    if kind == "shared":
        rng = np.random.default_rng(seed)
        base = rng.integers(1000, 30000, min(n, 2048))
        donors = draw(st.integers(min_value=1, max_value=300))
        heads = [rng.integers(1000, 30000, 16) for _ in range(donors + 1)]
        return Stream(
            "shared",
            tuple(np.concatenate([h, base]) for h in heads[:-1]),
            np.concatenate([heads[-1], base]),
        )
    return long_similar(n, seed=seed)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams(), budget_ms=st.sampled_from([0.05, 0.5, 5.0]))
def test_adversarial_streams_stay_within_the_budget_and_decide_alike(
    stream: Stream, budget_ms: float
) -> None:
    """On any stream: the lookup never raises, spends at most its budget, plans only identical
    spans, and two providers fed the same calls (two tensor-parallel ranks) decide alike."""
    _Recording.made.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(provider_module, "LookupBudget", _Recording)
        first = _provider(stream, budget_ms)
        a = first.lookup(LookupParams(NS, stream.query, 0, "r"))
        b = _provider(stream, budget_ms).lookup(LookupParams(NS, stream.query, 0, "r"))
    assert [0 <= x.remaining <= x.total for x in _Recording.made] == [True] * len(_Recording.made)
    assert (a.kind, a.reason, a.plan) == (b.kind, b.reason, b.plan)
    assert a.reason != Reason.COLD_FALLBACK  # no error inside the lookup
    _check_plan(stream, first, a)


def test_a_long_prompt_over_the_budget_goes_on_cold_counted() -> None:
    stream = long_similar(20_000)
    tight = _provider(stream, 0.05)  # 50,000 units: less than hashing 20,000 tokens
    decision = tight.lookup(LookupParams(NS, stream.query, 0, None))
    assert decision.kind == "decline" and decision.reason == Reason.LOOKUP_BUDGET
    assert tight.snapshot()["declined"].get(Reason.LOOKUP_BUDGET) == 1
    roomy = _provider(stream, 5.0)
    planned = roomy.lookup(LookupParams(NS, stream.query, 0, None))
    assert planned.kind == "plan"
    _check_plan(stream, roomy, planned)


def test_a_spent_budget_keeps_the_plan_found_so_far() -> None:
    """On a repeated token the diagonals are cut to what the budget affords; the alignment still
    finds the identical run."""
    stream = repeated_token(12_000)
    provider = _provider(stream, 1.0)
    decision = provider.lookup(LookupParams(NS, stream.query, 0, None))
    assert decision.kind == "plan"
    assert sum(s.length for s in decision.plan.spans) >= 11_000
    _check_plan(stream, provider, decision)


def test_three_donors_of_8k_real_text_are_all_aligned_within_the_default_budget(
    smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    """rag_corpus at 8,112 tokens (real essays): each of the probe's four passages sits whole in
    one of three donors, and no donor holds all four. Within the default 5 ms budget the plan
    reuses >= 85% of the probe from >= 2 donors, >= 90% of every passage: the first
    alignment, charged for its most pairs and diagonals, must give back what it did not use, or
    the next donors never fit."""
    from semblend_sglang.bench.builtin_workloads import build_workload

    workload = build_workload("rag_corpus", smollm2_tokenizer, essay_texts, 8112, 2, seed=0)
    for group in workload.groups:
        provider = SemanticProvider(Config(), registry=CollectorRegistry())
        donors = [r for r in group.requests if r.role == "donor"]
        (probe,) = [r for r in group.requests if r.role == "probe"]
        for handle, donor in enumerate(donors):
            provider.register(NS, handle, donor.prompt_ids)
        decision = provider.lookup(LookupParams(NS, probe.prompt_ids, 0, None))
        assert decision.kind == "plan", decision.reason
        plan = decision.plan
        assert plan.reused_tokens >= 0.85 * len(probe.prompt_ids), plan.reused_tokens
        assert len(plan.donors) >= 2 and 2 <= len(plan.spans) <= 4
        # every passage reused (two passages one donor holds adjacent, in the probe's order,
        # may make one span: the labels name no place)
        covered = np.zeros(len(probe.prompt_ids), dtype=bool)
        for span in plan.spans:
            covered[span.target_start : span.target_end] = True
        ids = list(probe.prompt_ids)
        for passage in group.shared_spans:
            at = next(k for k in range(len(ids)) if ids[k : k + len(passage)] == list(passage))
            assert covered[at : at + len(passage)].mean() >= 0.9, at
        for i, span in enumerate(plan.spans):
            donor_ids = np.asarray(donors[plan.donor_of(i)].prompt_ids)
            target = np.asarray(probe.prompt_ids)[span.target_start : span.target_end]
            assert np.array_equal(target, donor_ids[span.donor_start : span.donor_end])
