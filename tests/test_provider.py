"""SemanticProvider on real essays: shifts, reordering, determinism, caching, failures, threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from semblend_sglang.config import Config
from semblend_sglang.locate import LocateParams, SpanSource
from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace
from semblend_sglang.passages import donor_runs
from semblend_sglang.plan import Decision
from semblend_sglang.provider import SemanticProvider

NS = Namespace("SmolLM2-135M-Instruct", "fp")


@pytest.fixture(scope="module")
def essay_ids(smollm2_tokenizer: Any, essay_texts: list[str]) -> np.ndarray:
    """Token ids of the 49 real essays, concatenated."""
    ids = [smollm2_tokenizer(t, add_special_tokens=False)["input_ids"] for t in essay_texts]
    return np.asarray([tok for part in ids for tok in part], dtype=np.int64)


def new_provider(config: Config | None = None, **kwargs: Any) -> SemanticProvider:
    return SemanticProvider(config or Config(), registry=CollectorRegistry(), **kwargs)


@pytest.mark.parametrize("with_source", [False, True])
@pytest.mark.parametrize("shift", [1, 3, 17, 64, 250, 1000, 2500, 4000, 5000])
def test_shifted_context_is_reused(essay_ids: np.ndarray, shift: int, with_source: bool) -> None:
    donors = {f"d{i}": essay_ids[i * 5000 : i * 5000 + 3000] for i in range(6)}
    source = donors.get if with_source else None
    provider = new_provider(token_source=source)
    for handle, tokens in donors.items():
        provider.register(NS, handle, tokens)
    target = np.concatenate([essay_ids[100000 : 100000 + shift], donors["d3"]])
    decision = provider.lookup(LookupParams(NS, target, 0, "req", page_size=16))
    assert decision.kind == "plan", decision.reason
    plan = decision.plan
    assert plan is not None and plan.donor_handle == "d3"
    (span,) = plan.spans
    assert span.delta == shift
    assert span.target_start >= shift + 4 and span.target_start % 16 == 0
    assert span.target_end <= target.size - 1
    assert plan.reused_tokens >= 3000 - 4 - 2 * 16
    assert np.array_equal(
        target[span.target_start : span.target_end], donors["d3"][span.donor_start : span.donor_end]
    )


def test_reordered_passages_are_all_reused(essay_ids: np.ndarray) -> None:
    passages = [essay_ids[s : s + 500] for s in (3000, 13000, 23000, 33000, 43000, 53000)]
    donor = np.concatenate(passages)
    target = np.concatenate([essay_ids[70000:70040]] + [passages[k] for k in (4, 1, 5, 0, 3, 2)])
    config = Config(strict_prefix_boundary=False, max_spans=8, sink_tokens=0)
    provider = new_provider(config)
    provider.register(NS, "rag", donor)
    decision = provider.lookup(LookupParams(NS, target, 0, "q"))
    assert decision.plan is not None
    assert len(decision.plan.spans) == 6
    assert decision.plan.reused_tokens >= 6 * 500 - 1  # the last token is left to compute
    # strict_prefix_boundary plans one region: 500 of 3,040 tokens is too little
    strict = new_provider(Config(strict_prefix_boundary=True, sink_tokens=0))
    strict.register(NS, "rag", donor)
    assert strict.lookup(LookupParams(NS, target, 0, "q")).reason == "reuse_ratio_low"
    lenient = new_provider(Config(strict_prefix_boundary=True, sink_tokens=0, min_reuse_ratio=0.1))
    lenient.register(NS, "rag", donor)
    one = lenient.lookup(LookupParams(NS, target, 0, "q"))
    assert one.plan is not None and len(one.plan.spans) == 1


def test_locate_finds_each_passage_in_the_donor_that_holds_it_and_keeps_nothing(
    essay_ids: np.ndarray,
) -> None:
    passages = [essay_ids[s : s + 400] for s in (3000, 13000, 23000, 33000, 43000)]
    first = np.concatenate([essay_ids[60000:60030], passages[0], passages[1], passages[2]])
    second = np.concatenate([essay_ids[61000:61050], passages[3]])
    provider = new_provider()
    provider.register(NS, "first", first)
    provider.register(NS, "second", second)
    # the request as sent: its own head, then passages 2, 3, 0, 1, and one no donor holds
    head = essay_ids[70000:70020]
    target = np.concatenate([head, passages[2], passages[3], passages[0], passages[1]])
    target = np.concatenate([target, essay_ids[80000:80400]])
    bounds = tuple((20 + 400 * k, 20 + 400 * (k + 1)) for k in range(5))
    before = provider.snapshot()
    sources = provider.locate(LocateParams(NS, target, bounds)).sources
    assert sources == (
        SpanSource(0, 30 + 800),
        SpanSource(1, 50),
        SpanSource(0, 30),
        SpanSource(0, 30 + 400),
        None,
    )
    # places 2, 3, 0 hold the first donor's passages back to back: one run, in its order
    assert donor_runs(range(5), [400] * 5, sources) == ((1, 2, 3, 0, 4), 2)
    assert provider.snapshot() == before  # no lookup, outcome or error counted
    other = Namespace("another-model", "fp")
    assert provider.locate(LocateParams(other, target, bounds)).sources == (None,) * 5


def test_locate_errors_locate_nothing(essay_ids: np.ndarray) -> None:
    provider = new_provider()
    provider.register(NS, "d", essay_ids[:3000])
    bounds = ((0, 1000), (1000, 2000))
    provider.index.candidates = None  # type: ignore[method-assign]  # a broken index
    assert provider.locate(LocateParams(NS, essay_ids[:2000], bounds)).sources == (None, None)
    assert provider.snapshot()["errors"].get("locate") == 1


def test_exact_len_is_respected(essay_ids: np.ndarray) -> None:
    provider = new_provider()
    provider.register(NS, "d", essay_ids[:3000])
    decision = provider.lookup(LookupParams(NS, essay_ids[:2000], 512, "q"))
    assert decision.plan is not None
    assert decision.plan.exact_len == 512
    assert decision.plan.spans[0].target_start >= 512 + 4
    assert decision.plan.spans[0].delta == 0


def test_repeated_lookup_is_cached_until_release(essay_ids: np.ndarray) -> None:
    calls = []

    def source(handle: Any) -> np.ndarray:
        calls.append(handle)
        return essay_ids[:3000]

    provider = new_provider(token_source=source)
    provider.register(NS, "d", essay_ids[:3000])
    target = np.concatenate([essay_ids[9000:9100], essay_ids[:3000]])
    first = provider.lookup(LookupParams(NS, target, 0, "q"))
    for _ in range(50):
        assert provider.lookup(LookupParams(NS, target, 0, "q")) is first
    assert calls == ["d"]
    assert provider.snapshot()["lookups"] == 1
    provider.release("q")
    assert provider.lookup(LookupParams(NS, target, 0, "q")) == first
    assert calls == ["d", "d"]


def test_evicted_donor_is_forgotten_and_the_next_candidate_used(essay_ids: np.ndarray) -> None:
    store = {"newer": essay_ids[:3000], "older": essay_ids[:3000].copy()}
    provider = new_provider(token_source=store.get)
    provider.register(NS, "older", store["older"])
    provider.register(NS, "newer", store["newer"])
    del store["newer"]  # the engine evicted it
    target = np.concatenate([essay_ids[9000:9100], essay_ids[:3000]])
    decision = provider.lookup(LookupParams(NS, target, 0, "q"))
    assert decision.plan is not None and decision.plan.donor_handle == "older"
    assert "newer" not in provider.index
    del store["older"]
    assert provider.lookup(LookupParams(NS, target, 0, "q2")).reason == "donor_evicted"
    assert len(provider.index) == 0


def test_errors_never_reach_the_caller(essay_ids: np.ndarray) -> None:
    provider = new_provider()
    provider.register(NS, "bad", np.zeros((3, 3), dtype=np.int64))  # 2-D: rejected, counted
    provider.register(NS, "neg", [-1] * 100)
    assert provider.lookup(LookupParams(NS, [-5] * 400, 0, "q1")).reason == "cold_fallback"
    assert provider.lookup(LookupParams(NS, "not tokens", 0, "q2")).reason == "cold_fallback"  # type: ignore[arg-type]
    provider.forget(["unhashable"])  # type: ignore[arg-type]
    snap = provider.snapshot()
    assert snap["errors"]["register"] == 2
    assert snap["errors"]["lookup"] == 2
    assert snap["errors"]["forget"] == 1
    assert snap["outcomes"]["cold_fallback"] == 2


def test_discovery_only_reports_evidence_and_never_plans(essay_ids: np.ndarray) -> None:
    provider = new_provider(Config.from_env({"SEMBLEND_DISCOVERY_ONLY": "1"}))
    provider.register(NS, "d", essay_ids[:3000])
    target = np.concatenate([essay_ids[9000:9100], essay_ids[:3000]])
    decision = provider.lookup(LookupParams(NS, target, 0, "q"))
    assert decision.kind == "decline" and decision.reason == "discovery_only"
    assert decision.plan is None
    assert decision.evidence is not None and decision.evidence.donor_handle == "d"
    assert provider.snapshot()["outcomes"]["discovery_only"] == 1


def test_substitute_mode_with_sketch_similarity(essay_ids: np.ndarray) -> None:
    config = Config.from_env(
        {
            "SEMBLEND_MODE": "substitute",
            "SEMBLEND_EXACT_MATERIALIZATION_ONLY": "0",
            "SEMBLEND_EMBEDDER": "jaccard",
            "SEMBLEND_MIN_SIMILARITY": "0.2",
        }
    )
    provider = new_provider(config)
    donor = essay_ids[:3000]
    provider.register(NS, "d", donor)
    edited = donor.copy()
    edited[2000:2600:25] = essay_ids[90000:90024]  # one token in 25 changed in one region
    decision = provider.lookup(
        LookupParams(NS, np.concatenate([essay_ids[9000:9050], edited]), 0, "q")
    )
    assert decision.plan is not None
    assert decision.plan.substitute is True
    assert decision.plan.similarity is not None and decision.plan.similarity >= 0.2
    strict = new_provider(
        Config(
            mode="substitute",
            exact_materialization_only=False,
            embedder="jaccard",
            min_similarity=1.0,
        )
    )
    strict.register(NS, "d", donor)
    far = np.concatenate([essay_ids[50000:52500], donor[:600]])
    assert strict.lookup(LookupParams(NS, far, 0, "q")).reason in (
        "similarity_low",
        "reuse_ratio_low",
    )


def _scenario_calls(essay_ids: np.ndarray) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    for i in range(30):
        start = (i * 3331) % (essay_ids.size - 3000)
        calls.append(("register", (f"d{i}", start, 2000 + (i % 5) * 200)))
        if i % 7 == 3:
            calls.append(("forget", f"d{i - 2}"))
    for q in range(25):
        start = (q * 5227 + 11) % (essay_ids.size - 3000)
        calls.append(("lookup", (f"q{q}", start, 50 + q, (q * 16) % 200)))
    return calls


def run_scenario(essay_ids: np.ndarray) -> list[str]:
    """Feed a fixed call sequence to a fresh provider; return its decisions (and where it
    locates five passages of each looked-up prompt) as text."""
    provider = SemanticProvider(
        Config(max_donors=20, strict_prefix_boundary=False), registry=CollectorRegistry()
    )
    out: list[str] = []
    for kind, args in _scenario_calls(essay_ids):
        if kind == "register":
            handle, start, length = args
            provider.register(NS, handle, essay_ids[start : start + length])
        elif kind == "forget":
            provider.forget(args)
        else:
            rid, start, head, exact = args
            target = np.concatenate([essay_ids[-head:], essay_ids[start : start + 2500]])
            out.append(
                describe(provider.lookup(LookupParams(NS, target, exact, rid, page_size=16)))
            )
            bounds = tuple((head + 500 * k, head + 500 * (k + 1)) for k in range(5))
            located = provider.locate(LocateParams(NS, target, bounds)).sources
            out.append(json.dumps([None if s is None else [s.donor, s.start] for s in located]))
    return out


def describe(decision: Decision) -> str:
    plan = decision.plan
    spans = [] if plan is None else [(s.target_start, s.donor_start, s.length) for s in plan.spans]
    return json.dumps([decision.kind, decision.reason, plan and plan.donor_handle, spans])


def test_two_providers_fed_the_same_calls_decide_identically(
    essay_ids: np.ndarray, tmp_path: Path
) -> None:
    first = run_scenario(essay_ids)
    assert first == run_scenario(essay_ids)
    assert sum('"plan"' in d for d in first) >= 5  # the scenario exercises real plans
    assert sum(d.count("[") > 1 for d in first[1::2]) >= 5  # and passages found in donors
    np.save(tmp_path / "ids.npy", essay_ids)
    code = (
        "import json, sys, numpy as np;"
        f"sys.path.insert(0, r'{Path(__file__).parent}');"
        "import test_provider as t;"
        f"print(json.dumps(t.run_scenario(np.load(r'{tmp_path / 'ids.npy'}'))))"
    )
    env = dict(os.environ, PYTHONHASHSEED="31337")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == first


def test_eight_threads_lose_no_donor_and_raise_nothing(essay_ids: np.ndarray) -> None:
    provider = new_provider(Config(max_donors=10000))
    errors: list[BaseException] = []
    decisions: list[Decision] = []
    lock = threading.Lock()
    per_thread = 40
    barrier = threading.Barrier(8)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                start = ((t * per_thread + i) * 1499) % (essay_ids.size - 2000)
                provider.register(NS, (t, i), essay_ids[start : start + 1500])
                target = np.concatenate([essay_ids[-37:], essay_ids[start : start + 1500]])
                d = provider.lookup(LookupParams(NS, target, 0, f"{t}-{i}"))
                with lock:
                    decisions.append(d)
                if i % 3 == 0:
                    provider.release(f"{t}-{i}")
        except BaseException as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(provider.index) == 8 * per_thread
    assert set(provider.index.handles()) == {(t, i) for t in range(8) for i in range(per_thread)}
    assert len(decisions) == 8 * per_thread
    assert all(d.kind == "plan" for d in decisions), {d.reason for d in decisions}
    snap = provider.snapshot()
    assert snap["errors"] == {}
    assert snap["outcomes"]["cold_fallback"] == 0


@pytest.mark.parametrize("passage_tokens", [100, 120, 250])
def test_passages_seen_in_different_donors_are_reused_from_each(
    essay_ids: np.ndarray, passage_tokens: int
) -> None:
    """RAG over a shared corpus: each passage of the target was seen in another earlier request
    (with other passages and another instruction around it); the plan takes every passage from
    the donor that has it."""
    corpus = [essay_ids[s : s + passage_tokens] for s in range(1000, 1000 + 40 * 997, 997)]
    rng = np.random.default_rng(passage_tokens)
    label = essay_ids[90000:90008]
    target_ids = [3, 17, 25, 9]
    donors = {}
    for k, pid in enumerate(target_ids):
        others = [int(x) for x in rng.choice([i for i in range(40) if i not in target_ids], 3)]
        order = [pid, *others]
        rng.shuffle(order)
        parts = [essay_ids[80000 + 50 * k : 80040 + 50 * k]]
        for j in order:
            parts += [label, corpus[j]]
        donors[f"d{k}"] = np.concatenate(parts)
    provider = new_provider(Config(min_prompt_tokens=64, min_reuse_tokens=32))
    for handle, tokens in donors.items():
        provider.register(NS, handle, tokens)
    parts = [essay_ids[70000:70030]]
    for pid in target_ids[::-1]:
        parts += [label, corpus[pid]]
    target = np.concatenate([*parts, essay_ids[95000:95020]])
    decision = provider.lookup(LookupParams(NS, target, 0, "q"))
    assert decision.plan is not None, decision
    plan = decision.plan
    assert set(plan.donors) == set(donors)  # one donor per passage
    reused = plan.reused_tokens
    assert reused >= 4 * (passage_tokens - Config().sink_tokens) - 8, reused
    for i, span in enumerate(plan.spans):  # every span is the donor's own tokens
        donor = donors[plan.donor_of(i)]
        assert np.array_equal(
            target[span.target_start : span.target_end],
            donor[span.donor_start : span.donor_end],
        )
    ends = [s.target_end for s in plan.spans]
    starts = [s.target_start for s in plan.spans]
    assert all(e <= s for e, s in zip(ends, starts[1:], strict=False))  # no overlap
    one = new_provider(Config(min_prompt_tokens=64, min_reuse_tokens=32, max_plan_donors=1))
    for handle, tokens in donors.items():
        one.register(NS, handle, tokens)
    single = one.lookup(LookupParams(NS, target, 0, "q"))
    assert single.plan is None or len(single.plan.donors) == 1


@pytest.mark.parametrize("multi_donor", [True, False])
def test_an_evicted_candidate_is_forgotten_and_the_next_one_used(
    essay_ids: np.ndarray, multi_donor: bool
) -> None:
    """Two donors hold the same document; the engine says the newer (the first candidate) lost
    its KV: the lookup forgets it and plans from the other, instead of declining."""
    config = Config(max_plan_donors=8 if multi_donor else 1)
    provider = new_provider(config)
    doc = essay_ids[20000:22000]
    provider.register(NS, "old", np.concatenate([essay_ids[:40], doc]))
    provider.register(NS, "new", np.concatenate([essay_ids[50:90], doc]))
    target = np.concatenate([essay_ids[60000:60040], doc])
    asked: list[Any] = []

    def alive(handle: Any, tokens: np.ndarray) -> int:
        asked.append(handle)
        return 0 if handle == "new" else len(tokens)

    decision = provider.lookup(LookupParams(NS, target, 0, "r1", alive=alive))
    assert decision.kind == "plan", decision.reason
    assert decision.plan is not None and set(decision.plan.donors) == {"old"}
    assert asked[0] == "new" and "old" in asked
    assert provider.donor_tokens("new") is None  # forgotten
    half = provider.lookup(LookupParams(NS, target, 0, "r2", alive=lambda h, t: 40 + 1000))
    assert half.kind == "plan" and half.plan is not None
    assert max(s.donor_end for s in half.plan.spans) <= 1040  # only what is left is aligned
    gone = provider.lookup(LookupParams(NS, target, 0, "r3", alive=lambda h, t: 0))
    assert gone.kind == "decline" and gone.reason == "donor_evicted"
