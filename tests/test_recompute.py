"""The recompute selection (semblend_sglang.recompute) against plain-loop references."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from semblend_sglang import recompute
from semblend_sglang.config import Config
from semblend_sglang.recompute import RecomputeStrategy


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.15, 0.3, 0.999, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_head_lengths_spend_the_budget_alike_on_every_span(ratio: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = [
        int(x)
        for x in torch.randint(1, 300, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
    ]
    heads = recompute.head_lengths(lengths, ratio)
    budget = recompute.budget(sum(lengths), ratio)
    assert len(heads) == len(lengths)
    assert all(0 <= h <= n for h, n in zip(heads, lengths, strict=True))
    assert budget <= sum(heads) < budget + len(lengths)
    if budget:
        k = max(heads)  # every span not exhausted takes the same k
        assert all(h == k or h == n for h, n in zip(heads, lengths, strict=True))
        smaller = sum(min(k - 1, n) for n in lengths)
        assert smaller < budget  # k is the smallest share that reaches the budget
    else:
        assert sum(heads) == 0


def test_budget_rounds_up_and_is_capped() -> None:
    assert recompute.budget(1000, 0.15) == 150
    assert recompute.budget(7, 0.15) == 2  # ceil(1.05)
    assert recompute.budget(7, 1.0) == 7
    assert recompute.budget(0, 0.5) == 0
    assert recompute.budget(10, 0.0) == 0


@pytest.mark.parametrize("seed", range(4))
def test_kv_deviation_equals_a_per_token_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n, h, d = 17, 3, 8
    k_new, v_new, k_old, v_old = (torch.randn(n, h, d, generator=g) for _ in range(4))
    diff, norm = recompute.kv_deviation(k_new, v_new, k_old, v_old)
    for i in range(n):
        want_diff = float(((k_new[i] - k_old[i]) ** 2).sum() + ((v_new[i] - v_old[i]) ** 2).sum())
        want_norm = float((k_new[i] ** 2).sum() + (v_new[i] ** 2).sum())
        assert math.isclose(float(diff[i]), want_diff, rel_tol=1e-5)
        assert math.isclose(float(norm[i]), want_norm, rel_tol=1e-5)
    rel = recompute.relative(diff, norm)
    assert torch.allclose(rel, diff / norm)
    assert float(recompute.relative(torch.ones(1), torch.zeros(1))) == 0.0


@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (9, 3)])
def test_query_attention_equals_a_per_head_softmax_loop(heads: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(sum(heads))
    hq, hkv = heads
    t, n, d, scale = 5, 11, 16, 0.25
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g)
    got = recompute.query_attention(q, k, scale)
    want = torch.zeros(n)
    group = hq // hkv
    for qi in range(t):
        for head in range(hq):
            logits = torch.stack([q[qi, head] @ k[j, head // group] for j in range(n)]) * scale
            want += torch.softmax(logits, 0)
    want /= t * hq
    assert torch.allclose(got, want, atol=1e-6)
    assert math.isclose(float(got.sum()), 1.0, rel_tol=1e-5)
    assert recompute.query_attention(q[:0], k, scale).tolist() == [0.0] * n


def test_top_takes_the_highest_scores_and_breaks_ties_by_position() -> None:
    scores = torch.tensor([0.5, 0.9, 0.5, 0.1, 0.9, 0.5])
    assert recompute.top(scores, 2).tolist() == [1, 4]
    assert recompute.top(scores, 3).tolist() == [0, 1, 4]  # the first 0.5
    assert recompute.top(scores, 4).tolist() == [0, 1, 2, 4]
    assert recompute.top(scores, 0).tolist() == []
    assert recompute.top(scores, 10).tolist() == list(range(6))
    # the same on a permuted copy names the same scores
    perm = torch.tensor([5, 3, 1, 0, 4, 2])
    picked = perm[recompute.top(scores[perm], 2)].sort().values.tolist()
    assert picked == [1, 4]


def test_gate_refuses_only_when_what_is_left_deviates_beyond_the_threshold() -> None:
    deviation = torch.tensor([0.9, 0.01, 0.02, 0.8, 0.03])
    chosen = torch.tensor([0, 3])
    refused, residual = recompute.gate(deviation, chosen, 0.05)
    assert not refused and math.isclose(residual, 0.02, rel_tol=1e-6)
    refused, residual = recompute.gate(deviation, chosen, 0.01)
    assert refused
    assert recompute.gate(deviation, chosen, 0.0)[0] is False  # the gate off
    assert recompute.gate(deviation, torch.arange(5), 1e-9) == (False, 0.0)


def test_select_takes_the_budget_by_score_and_everything_when_gated() -> None:
    deviation = torch.tensor([0.1, 0.5, 0.2, 0.4, 0.3, 0.0, 0.05, 0.6, 0.01, 0.02])
    sel = recompute.select(deviation, deviation, 0.3, 0.0)
    assert sel.recompute.tolist() == [1, 3, 7] and not sel.gated
    assert math.isclose(sel.residual_deviation, float(deviation[[0, 2, 4, 5, 6, 8, 9]].mean()))
    by_query = recompute.select(torch.arange(10.0), deviation, 0.2, 0.0)
    assert by_query.recompute.tolist() == [8, 9]
    gated = recompute.select(deviation, deviation, 0.3, 0.05)
    assert gated.gated and gated.recompute.tolist() == list(range(10))


def test_a_minimum_deviation_makes_the_ratio_a_per_request_ceiling() -> None:
    """Only candidates whose K/V moved at least the minimum are recomputed, at most the ratio's
    budget, best score first; a request whose reused KV barely moved recomputes nothing."""
    deviation = torch.tensor([0.1, 0.5, 0.2, 0.4, 0.3, 0.0, 0.05, 0.6, 0.01, 0.02])
    capped = recompute.select(deviation, deviation, 0.3, 0.0, min_deviation=0.25)
    assert capped.recompute.tolist() == [1, 3, 7]  # four qualify, the ceiling takes three
    few = recompute.select(deviation, deviation, 0.5, 0.0, min_deviation=0.45)
    assert few.recompute.tolist() == [1, 7]  # under the ceiling: just the two that moved
    calm = recompute.select(deviation, deviation, 0.5, 0.0, min_deviation=0.9)
    assert calm.recompute.numel() == 0 and not calm.gated
    assert math.isclose(calm.residual_deviation, float(deviation.mean()))
    by_query = recompute.select(torch.arange(10.0), deviation, 0.5, 0.0, min_deviation=0.25)
    assert by_query.recompute.tolist() == [1, 3, 4, 7]  # eligible by deviation, ranked by query
    assert recompute.select(deviation, deviation, 0.3, 0.0, 0.0).recompute.tolist() == [1, 3, 7]


def test_only_heads_needs_no_check_layer() -> None:
    assert not RecomputeStrategy.HEADS.uses_check_layer
    assert RecomputeStrategy.DEVIATION.uses_check_layer
    assert RecomputeStrategy.QUERY.uses_check_layer
    assert tuple(recompute.RecomputeStrategy) == ("heads", "deviation", "query")


@pytest.mark.parametrize("share", [0.01, 0.1, 0.15, 0.3, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("length", [1, 2, 7, 100, 333, 2048])
def test_check_sample_takes_the_span_head_and_a_share_spread_evenly(
    length: int, share: float
) -> None:
    offsets = recompute.check_sample(length, share).tolist()
    # the plain-loop reference: the first position, then every 1/share (rounded up)
    want: list[int] = []
    m = 0
    while (at := math.ceil(m / share - 1e-9)) < length:
        want.append(at)
        m += 1
    assert offsets == want
    assert offsets[0] == 0 and offsets == sorted(set(offsets))
    assert len(offsets) == math.floor((length - 1) * share + 1e-9) + 1  # about share * length
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert all(math.floor(1 / share) <= g <= math.ceil(1 / share) for g in gaps)
    assert recompute.check_sample(0, share).numel() == 0


def test_a_sampled_check_spends_the_budget_of_every_reused_position_on_the_sample() -> None:
    """With candidates sampled out of ``reused`` positions, the budget is the ratio of all of
    them, taken from the sample by score, and never more than the sample holds."""
    deviation = torch.tensor([0.1, 0.5, 0.2, 0.4, 0.3, 0.0, 0.05, 0.6, 0.01, 0.02])
    sel = recompute.select(deviation, deviation, 0.15, 0.0, reused=40)  # budget 6 of 10
    assert sel.recompute.tolist() == [0, 1, 2, 3, 4, 7]
    capped = recompute.select(deviation, deviation, 0.5, 0.0, reused=40)  # budget 20 > 10
    assert capped.recompute.tolist() == list(range(10)) and capped.residual_deviation == 0.0
    floor = recompute.select(deviation, deviation, 0.5, 0.0, min_deviation=0.25, reused=40)
    assert floor.recompute.tolist() == [1, 3, 4, 7]
    same = recompute.select(deviation, deviation, 0.3, 0.0, reused=10)
    assert (
        same.recompute.tolist()
        == recompute.select(deviation, deviation, 0.3, 0.0).recompute.tolist()
    )


def _sampling(
    share: float, max_spans: int, gate: float, span_limit: int = 0
) -> recompute.CheckSampling:
    return recompute.CheckSampling.of(
        Config(
            recompute_check_share=share,
            recompute_check_max_spans=max_spans,
            quality_gate=gate,
            recompute_check_span_limit=span_limit,
        )
    )


def test_only_plans_of_few_spans_are_checked_on_a_sample_and_none_under_the_gate() -> None:
    sampling = _sampling(0.15, 1, 0.0)
    assert [sampling.share_for(n) for n in (1, 2, 8)] == [0.15, 1.0, 1.0]
    wider = _sampling(0.15, 4, 0.0)
    assert [wider.share_for(n) for n in (1, 4, 5)] == [0.15, 0.15, 1.0]
    assert _sampling(0.15, 0, 0.0).share_for(1) == 1.0  # 0: no plan
    # the quality gate recomputes every reused position, so every one must be scored
    assert _sampling(0.15, 8, 1e-3).share_for(1) == 1.0
    assert _sampling(1.0, 8, 0.0).share_for(1) == 1.0
    assert recompute.CheckSampling().share_for(1) == 1.0
    assert recompute.CheckSampling.of(Config()) == recompute.CheckSampling(0.15, 1, 128)


@pytest.mark.parametrize("length", [1, 7, 100, 1706, 8000])
@pytest.mark.parametrize("limit", [1, 16, 256])
def test_a_span_limit_caps_the_sample_of_a_sampled_plan_only(length: int, limit: int) -> None:
    """With a span limit the check samples at most ``limit`` positions of a span (its first, then
    evenly spread), so the check's cost stops growing with the prompt; below the limit the share
    alone decides, and a dense check (a plan of more spans) keeps every position."""
    sampling = _sampling(0.15, 1, 0.0, span_limit=limit)
    offsets = sampling.sample(1, length).tolist()
    share_only = recompute.check_sample(length, 0.15).tolist()
    if len(share_only) <= limit:
        assert offsets == share_only
    else:
        assert len(offsets) == limit and offsets[0] == 0
        assert offsets == sorted(set(offsets)) and offsets[-1] < length
        gaps = [b - a for a, b in itertools.pairwise(offsets)]
        assert all(math.floor(length / limit) <= g <= math.ceil(length / limit) for g in gaps)
    assert sampling.sample(2, length).tolist() == list(range(length))  # dense: no limit
    assert _sampling(0.15, 1, 0.0).sample(1, length).tolist() == share_only  # 0: no limit


def test_the_second_check_sits_at_a_share_of_the_depth_between_the_check_and_the_last() -> None:
    assert recompute.recheck_layer(0.0, 1, 24) is None
    assert recompute.recheck_layer(0.5, 1, 24) == 12
    assert recompute.recheck_layer(0.5, 1, 30) == 15
    assert recompute.recheck_layer(0.5, 1, 4) == 2
    # not after the check layer, or the last layer (nothing would follow it)
    assert recompute.recheck_layer(0.25, 1, 4) is None
    assert recompute.recheck_layer(0.5, 12, 24) is None
    assert recompute.recheck_layer(1.0, 1, 24) is None
    assert recompute.recheck_layer(0.96, 1, 24) is None  # layer 23 of 24, the last
    assert recompute.recheck_layer(0.9, 1, 24) == 22
