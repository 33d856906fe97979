"""SGLang's KL measure of semantic hits on the shared semblend server (SmolLM2, default settings).

Each answer's own output logprobs are compared with a cold, full-prefill replay of prompt + answer
(sglang's ``kl_test_utils.compare_kl_divergence``, the gate its CI puts on exact cache hits):
one-span plans (another instruction in front of the same essay slice) must stay at KL <=
:data:`ONE_SPAN_KL`, Irminsul's threshold for approximate reuse on SGLang; multi-span plans
(reordered RAG passages) are measured and printed (their KL depends on the probe: no gate), and the
exact hit of the same prompt gives the floor (float32 on CPU: 0 up to rounding). Every request
carries a cache salt of its own test, every replay one of its own (no flush of the shared server).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sglang.test.kl_test_utils import compare_kl_divergence

from semblend_sglang.bench.builtin_workloads import build_workload
from semblend_sglang.bench.client import cold_replay_logprobs
from semblend_sglang.bench.metrics import kl_divergence
from semblend_sglang.server import SglangServer
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e

ONE_SPAN_KL = 0.02
"""The gate on one-span hits: SGLang CI's exact-hit thresholds are 0.002-0.02, Irminsul's
approximate-reuse port on SGLang used 0.02."""
EXACT_KL = 1e-6
"""The floor an exact hit must stay under on the CPU server in float32 (decode vs prefill
rounding only: 6e-11 measured on 2026-12-02)."""
CONTEXT = 1024
PROBES = 3
ANSWER_TOKENS = 32
MODEL = "SmolLM2-135M-Instruct"


def _answer(
    url: str, ids: tuple[int, ...], salt: str, tokens: int = ANSWER_TOKENS
) -> dict[str, Any]:
    return generate(
        url,
        ids,
        tokens,
        sampling={"ignore_eos": True},
        return_logprob=True,
        cache_salt=salt,
    )


def _hits(
    url: str, workload: str, tokenizer: Any, essays: list[str]
) -> list[tuple[list[float], list[float], int]]:
    """For each probe of ``workload``: its donor, then the probe (materialized or the test
    fails); (output logprobs, cold replay logprobs, spans materialized)."""
    out = []
    built = build_workload(workload, tokenizer, essays, CONTEXT, PROBES, seed=5)
    for group in built.groups:
        salt = f"kl-{workload}-{uuid.uuid4().hex}"
        for donor in group.donors:
            _answer(url, donor.prompt_ids, salt, tokens=1)
        (probe,) = group.probes
        before = semblend_totals(url)
        got = _answer(url, probe.prompt_ids, salt)
        after = semblend_totals(url)
        spans = after["reused_spans"] - before["reused_spans"]
        materialized = after["outcomes"].get("materialized", 0)
        assert materialized - before["outcomes"].get("materialized", 0) == 1, group.group_id
        logprobs = [float(e[0]) for e in got["meta_info"]["output_token_logprobs"]]
        replay = cold_replay_logprobs(url, probe.prompt_ids, got["output_ids"])
        out.append((logprobs, replay, spans))
    return out


def _gate(samples: list[tuple[list[float], list[float], int]], limit: float, name: str) -> None:
    """sglang's own gate over ``samples`` (it averages the per-answer KLs)."""
    outputs = [s[0] for s in samples]
    replays = [s[1] for s in samples]
    compare_kl_divergence(replays, outputs, {MODEL: {"kl_div": limit}}, MODEL, name)


def test_one_span_hits_stay_under_the_kl_gate_and_multi_span_hits_are_measured(
    semblend_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str], capsys: Any
) -> None:
    url = semblend_server.url
    one_span = _hits(url, "cross_instruction", smollm2_tokenizer, essay_texts)
    assert all(spans == 1 for *_, spans in one_span)
    multi_span = _hits(url, "rag", smollm2_tokenizer, essay_texts)
    assert all(spans > 1 for *_, spans in multi_span)
    kls = {
        name: [kl_divergence(o, r) for o, r, _ in samples]
        for name, samples in (("one-span", one_span), ("multi-span", multi_span))
    }
    with capsys.disabled():
        for name, values in kls.items():
            mean = sum(values) / len(values)
            print(
                f"\nKL {name} ({CONTEXT} tokens, {len(values)} hits): mean {mean:.2e}, "
                f"max {max(values):.2e}"
            )
    _gate(one_span, ONE_SPAN_KL, "one-span semantic hits")
    # multi-span plans are reported, not gated: their KL depends on the probe (docs/perf.md,
    # 2026-12-02: means 2.5e-2 and 5.1e-2 over 6 rag and 6 rag_corpus probes, single answers
    # up to 0.22). What must hold is the instrument: a cold replay of approximate KV's answer
    # parts from it by more than the exact floor (a replay that reused the hit's own KV, or no
    # reuse at all, would read ~0)
    assert min(kls["multi-span"]) > EXACT_KL


def test_the_exact_hit_of_the_same_prompt_is_the_kl_floor(
    semblend_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    url = semblend_server.url
    built = build_workload("cross_instruction", smollm2_tokenizer, essay_texts, CONTEXT, 2, seed=6)
    samples = []
    for group in built.groups:
        (probe,) = group.probes
        salt = f"kl-exact-{uuid.uuid4().hex}"
        _answer(url, probe.prompt_ids, salt, tokens=1)
        got = _answer(url, probe.prompt_ids, salt)  # SGLang's exact prefix cache
        assert got["meta_info"]["cached_tokens"] >= len(probe.prompt_ids) - 1
        logprobs = [float(e[0]) for e in got["meta_info"]["output_token_logprobs"]]
        samples.append(
            (logprobs, cold_replay_logprobs(url, probe.prompt_ids, got["output_ids"]), 0)
        )
    _gate(samples, EXACT_KL, "exact hits")
