"""Bench metrics against hand-computed values."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from semblend_sglang.bench.metrics import (
    divergence_margin,
    first_divergence,
    fraction,
    greedy_agreement,
    input_logprobs_from_meta,
    kl_divergence,
    mcnemar_exact,
    miss_overhead,
    percentile,
    perplexity,
    ppl_ratio,
    read_answer,
    rouge_l,
    rouge_l_ids,
    summarize_ms,
)


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 1000) for _ in range(n)]
        for q in (0, 10, 25, 50, 90, 99, 100, 33.3):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20], 90) == 19.0  # 10 + 0.9 * 10
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5


def test_percentile_keeps_infinities_where_numpy_gives_nan() -> None:
    inf = math.inf
    assert percentile([inf, inf], 50) == inf and percentile([1.0, inf], 50) == inf
    assert percentile([1.0, 3.0, inf], 25) == 2.0


def test_percentile_errors() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="NaN"):
        percentile([1.0, math.nan], 50)


def test_summarize_ms() -> None:
    s = summarize_ms([400.0, 100.0, 300.0, 200.0])
    assert s == {"p50": 250.0, "p90": 370.0, "mean": 250.0, "min": 100.0, "max": 400.0, "n": 4}
    with pytest.raises(ValueError):
        summarize_ms([])


def test_miss_overhead_and_fraction() -> None:
    assert miss_overhead([105.0, 110.0, 100.0], [100.0, 100.0, 90.0]) == pytest.approx(0.05)
    assert fraction(3, 4) == 0.75 and fraction(0, 0) is None


def test_perplexity_and_ratio() -> None:
    assert perplexity([-1.0, -2.0]) == pytest.approx(math.exp(1.5))
    assert perplexity([0.0, 0.0]) == 1.0
    assert ppl_ratio([-1.0, -2.0], [-1.0, -1.0]) == pytest.approx(math.exp(1.5) / math.exp(1.0))
    assert ppl_ratio([-0.3, -0.7], [-0.3, -0.7]) == 1.0
    assert ppl_ratio([-1.0, -1.0], [-1.0, -2.0]) == pytest.approx(math.exp(-0.5))  # better
    # Long references do not overflow: exp of the mean difference, not a ratio of huge numbers.
    assert ppl_ratio([-800.0] * 3, [-799.0] * 3) == pytest.approx(math.e)
    assert perplexity([-math.inf, -1.0]) == math.inf


def test_perplexity_errors() -> None:
    with pytest.raises(ValueError, match="no values"):
        perplexity([])
    with pytest.raises(ValueError, match="2 test logprobs vs 3 cold"):
        ppl_ratio([-1.0, -1.0], [-1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="NaN"):
        ppl_ratio([math.nan], [-1.0])


def test_greedy_agreement() -> None:
    a = list(range(32))
    assert greedy_agreement(a, a) == 1.0
    assert greedy_agreement(a, [*a[:8], *(-1 for _ in range(24))]) == 8 / 32
    # A position present in one sequence only disagrees; missing from both agrees.
    assert greedy_agreement([1, 2, 3, 4], [1, 2], n=4) == 2 / 4
    assert greedy_agreement([1, 2, 3], [1, 2, 4], n=4) == 3 / 4
    assert greedy_agreement([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], n=4) == 1.0  # only i < n
    assert greedy_agreement([], [7], n=2) == 1 / 2
    with pytest.raises(ValueError):
        greedy_agreement([1], [1], n=0)


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [4]) == 0
    assert first_divergence([9], [4]) == 0


def test_divergence_margin_is_the_cold_margin_where_the_answers_first_differ() -> None:
    cold, margins = [1, 2, 3, 4], [0.5, 0.25, 0.125, 0.0625]
    assert divergence_margin([1, 2, 3, 4], cold, margins) is None
    assert divergence_margin([1, 9, 3, 9], cold, margins) == 0.25  # the first difference
    assert divergence_margin([1, 2, 3], cold, margins) == 0.0625  # the answer stopped early
    assert divergence_margin([1, 2, 3, 4, 5], cold, margins) is None  # no cold token there
    assert divergence_margin([1, 2, 3, 9], cold, margins, n=3) is None  # only i < n
    assert divergence_margin([1, 2, 9], cold, margins[:2]) is None  # no margin recorded there


def test_rouge_l() -> None:
    # LCS "the cat on the mat" = 5 of 6 words each way: P = R = F = 5/6.
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # LCS "a c" = 2: P = 2/4, R = 2/3, F = 2PR/(P+R) = 4/7.
    assert rouge_l("a b c d", "a c e") == pytest.approx(4 / 7)
    assert rouge_l("same words  here", "same\nwords here") == 1.0  # whitespace tokens
    assert rouge_l("x y", "a b") == 0.0
    assert rouge_l("", "") == 1.0 and rouge_l("", "a") == 0.0 and rouge_l("a", "") == 0.0
    # Order matters (subsequence, not bag of words): LCS of "c b a" and "a b c" is 1.
    assert rouge_l("c b a", "a b c") == pytest.approx(1 / 3)


def test_rouge_l_ids() -> None:
    assert rouge_l_ids([1, 2, 3, 4], [1, 3, 5]) == pytest.approx(4 / 7)
    assert rouge_l_ids((7, 8), (7, 8)) == 1.0
    assert rouge_l_ids([1, 2, 3, 4], [2, 4, 1, 3]) == pytest.approx(0.5)  # LCS 2 of 4 each


def _lcs_by_dynamic_programming(a: list[int], b: list[int]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, start=1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def test_rouge_l_ids_is_the_f1_of_the_textbook_lcs_on_random_sequences() -> None:
    """rapidfuzz's LCS (what rouge_l_ids uses) against the quadratic dynamic programme, on
    token-id sequences with repeats, long and empty ones."""
    rng = random.Random(11)
    for _ in range(200):
        a = [rng.randrange(50) for _ in range(rng.randrange(0, 120))]
        b = [rng.randrange(50) for _ in range(rng.randrange(0, 120))]
        lcs = _lcs_by_dynamic_programming(a, b)
        want = 1.0 if not a and not b else (0.0 if lcs == 0 else 2 * lcs / (len(a) + len(b)))
        assert rouge_l_ids(a, b) == pytest.approx(want), (a, b)


# The shape sglang 0.5.23 returns (tuples become JSON lists; first entry's logprob is null).
META = {
    "prompt_tokens": 4,
    "input_token_logprobs": [[None, 11, None], [-0.5, 12, None], [-1.25, 13, None]],
    "output_token_logprobs": [[-0.1, 99, None]],
}


def test_input_logprobs_from_meta() -> None:
    assert input_logprobs_from_meta(META, 2) == [-0.5, -1.25]
    assert input_logprobs_from_meta(META, 1) == [-1.25]
    assert input_logprobs_from_meta(META, 2, expected_ids=[12, 13]) == [-0.5, -1.25]
    with_text = {"input_token_logprobs": [(None, 1, "a"), (-2, 2, " b")]}  # text, ints, tuples
    assert input_logprobs_from_meta(with_text, 1) == [-2.0]


def test_input_logprobs_from_meta_errors() -> None:
    with pytest.raises(ValueError, match="no logprob"):
        input_logprobs_from_meta(META, 3)  # the first entry is null
    with pytest.raises(ValueError, match="3 input logprobs, need 4"):
        input_logprobs_from_meta(META, 4)
    with pytest.raises(ValueError, match="return_logprob"):
        input_logprobs_from_meta({"prompt_tokens": 4}, 1)
    with pytest.raises(ValueError, match="differ from the expected"):
        input_logprobs_from_meta(META, 2, expected_ids=[12, 14])
    with pytest.raises(ValueError, match="n must be"):
        input_logprobs_from_meta(META, 0)


def test_mcnemar_exact_known_values() -> None:
    assert mcnemar_exact(0, 5) == pytest.approx(0.0625)  # 2 * 1/32
    assert mcnemar_exact(1, 9) == pytest.approx(0.021484375)  # 2 * (1 + 10)/1024
    assert mcnemar_exact(9, 1) == pytest.approx(0.021484375)  # two-sided: symmetric in b and c
    assert mcnemar_exact(2, 10) == pytest.approx(0.03857421875)  # 2 * (1 + 12 + 66)/4096
    assert mcnemar_exact(0, 1) == 1.0  # 2 * 1/2
    # 2 * 1/64: the fewest discordant pairs under 0.05
    assert mcnemar_exact(0, 6) == pytest.approx(0.03125)
    for b in range(0, 12):
        assert mcnemar_exact(b, b) == 1.0  # capped at 1
    assert mcnemar_exact(0, 0) == 1.0  # no discordant pair: no evidence
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_exact(-1, 3)


def test_mcnemar_exact_is_twice_the_binomial_tail_for_any_counts() -> None:
    """Against the tail summed exactly in integers: b, c up to 24, and large counts."""
    for b, c in [*((b, c) for b in range(25) for c in range(25) if b + c), (600, 400)]:
        n = b + c
        tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
        assert mcnemar_exact(b, c) == pytest.approx(min(1.0, 2 * tail / 2**n), rel=1e-9), (b, c)


def test_read_answer_normalizes_like_the_scoring() -> None:
    # yes/no: the first yes/no word, whatever follows
    assert read_answer("No.\n\nThe passage says it is not.", "yes_no") == "no"
    assert read_answer("Yes, house tax and property tax are the same.", "yes_no") == "yes"
    assert read_answer("The passage does not say.", "yes_no") is None
    # span: the first non-blank line, SQuAD-normalized (case, punctuation, articles)
    assert read_answer("\nThe Afranji.\nQuestion: next", "span") == "afranji"
    assert read_answer("afranji", "span") == read_answer("The Afranji.", "span")
    assert read_answer("eight General Education categories", "span") == (
        "eight general education categories"
    )
    assert read_answer("", "span") == ""
    with pytest.raises(ValueError, match="answer kind"):
        read_answer("yes", "multiple_choice")


def test_kl_divergence_is_sglangs_own_kl_measure() -> None:
    """Ours against sglang's ``compare_kl_divergence`` (its CI's gate): on the same samples, a
    threshold just above our mean passes it and one just below fails it."""
    from sglang.test.kl_test_utils import compare_kl_divergence

    rng = random.Random(11)
    outputs = [[-rng.uniform(0.01, 4.0) for _ in range(n)] for n in (1, 7, 32)]
    replays = [[min(0.0, o + rng.gauss(0.0, 0.4)) for o in row] for row in outputs]
    ours = sum(kl_divergence(o, r) for o, r in zip(outputs, replays, strict=True)) / 3
    assert ours > 0

    def gate(threshold: float) -> None:
        limits = {"m": {"kl_div": threshold}}
        compare_kl_divergence(replays, outputs, limits, "m", "ours")

    gate(ours * (1 + 1e-9))
    with pytest.raises(AssertionError, match="avg_kl_div"):
        gate(ours * (1 - 1e-9))
    assert kl_divergence([-1.5, -0.2], [-1.5, -0.2]) == 0.0  # the cold distribution itself
    # exp(r) - 1 - r with r = replay - output, e.g. r = 1 at one token of two
    assert kl_divergence([-2.0, -1.0], [-1.0, -1.0]) == pytest.approx((math.e - 2) / 2)
    with pytest.raises(ValueError, match="1 output vs 2 replay"):
        kl_divergence([-1.0], [-1.0, -2.0])
    with pytest.raises(ValueError, match="no values"):
        kl_divergence([], [])
