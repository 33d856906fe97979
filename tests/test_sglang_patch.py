"""What the 0.5.23 adapter does beyond the adapter contract (tests/contract, which runs on this
version in `make test`): real UnifiedRadixCache, pools, allocator, PrefillAdder and ScheduleBatch
on CPU (tests/harness) with semblend's hooks installed.

Held donors (a recipient's unpublished prompt KV kept outside the tree, evicted first),
retraction under randomized multi-donor traffic, client-visible reuse reporting, a stale donor
skipped at lookup, cache reset, hook timing, the inherited `finish` hook, and substitute mode's
prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from semblend_sglang.config import Config
from semblend_sglang.patches.sglang import patch_radix_cache, unpatch_radix_cache
from semblend_sglang.patches.sglang.flow.donor_kv import held_of
from semblend_sglang.plan import Reason
from tests.harness import (
    HarnessConfig,
    SglangCacheHarness,
    assert_drained,
    check_invariants,
    document,
    drive_random,
    semantic_pair,
)
from tests.harness.reuse import check_loaded_kv, installed, materialized, step_until

CONFIG = Config(min_prompt_tokens=64, min_reuse_tokens=32, min_reuse_ratio=0.2)


@pytest.fixture
def adapter() -> Iterator[Any]:
    yield from installed(CONFIG)


def test_reuse_is_reported_to_the_client_only_when_configured(
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """``report_reuse_to_client``: the reused tokens join SGLang's ``cached_tokens`` (what
    ``meta_info`` returns); off (the default, test above) it stays the exact prefix."""
    hooks = installed(dataclasses.replace(CONFIG, report_reuse_to_client=True))
    adapter = next(hooks)
    try:
        h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
        doc = document(passages, 0, 8)
        h.submit(instructions[0] + doc)
        h.run_until_idle()
        target = h.submit(instructions[4] + instructions[2] + doc, max_new_tokens=2)

        step_until(h, lambda: materialized(adapter.flow, target.rid))
        reused = adapter.flow.requests[target.rid].reused_total
        h.run_until_idle()
        assert reused > 0 and target.finished()
        exact = target.cached_tokens - reused
        assert 0 <= exact < len(instructions[4])
        assert target.cached_tokens_device == target.cached_tokens
        check_invariants(h, full_kv=True)
    finally:
        hooks.close()


MULTI_SPAN = Config(
    min_prompt_tokens=64,
    min_reuse_tokens=32,
    min_reuse_ratio=0.2,
    strict_prefix_boundary=False,
    max_spans=8,
)


@pytest.fixture
def multi_span_adapter() -> Iterator[Any]:
    yield from installed(MULTI_SPAN)


def test_randomized_multi_donor_traffic_with_retraction_keeps_every_invariant(
    multi_span_adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    harness = SglangCacheHarness(
        HarnessConfig(pool_tokens=6144, chunked_prefill_size=256, max_running_requests=8),
        model_config,
    )
    counts = drive_random(
        harness, passages, instructions, 500, seed=11, retract=True, flow=multi_span_adapter.flow
    )
    snap = multi_span_adapter.runtime.snapshot()
    print(f"multi-span run: {harness.stats} {counts} {snap['outcomes']} {snap['declined']}")
    assert snap["outcomes"]["materialized"] >= 15, snap
    assert snap["multi_donor_requests"] >= 1, snap
    held = snap["held_donors"]
    assert held["kept"] >= 5, held
    assert counts["retracted"] >= 3 and counts["aborted"] >= 3, counts
    assert counts["aborted_with_plan"] >= 1, counts  # aborts mid-plan, not only of cold requests
    assert Reason.UNREPORTED not in snap["declined"], snap  # every plan's outcome was recorded
    assert snap["outcomes"]["cold_fallback"] == 0 and snap["errors"] == {}, snap
    assert not multi_span_adapter.flow.requests, "request state leaked past release"
    assert_drained(harness)


def test_a_donor_evicted_before_the_lookup_is_skipped_for_the_next_candidate(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """Two donors hold the same document; the newer one (the first candidate) has no KV left in
    the tree (its prompt is registered but was never published here: what an eviction the index
    has not heard of leaves). The lookup asks the tree, forgets it through the flow's DonorKV
    (its head watch too, not only the index), and plans from the older."""
    from semblend_sglang.patches.sglang.flow.donor_kv import cache_reuse
    from semblend_sglang.patches.sglang.request_info import namespace_for

    h = SglangCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    runtime = adapter.runtime
    doc = document(passages, 3, 8)
    older = instructions[0] + doc
    first = h.submit(older)
    h.run_until_idle()
    adapter.flow.donors.register(namespace_for(first), "gone", instructions[1] + doc)
    ghost = adapter.flow.donors.handle_of("gone")
    heads = cache_reuse(h.cache).heads
    assert heads is not None  # the older donor's head is watched
    heads.watch(ghost, 0)  # as if its head had been watched before an unheard-of eviction
    assert len(runtime.provider.index) == 2
    target = h.submit(instructions[2] + doc, max_new_tokens=2)
    step_until(h, lambda: materialized(adapter.flow, target.rid))
    state = adapter.flow.requests[target.rid]
    assert ghost not in state.plan.donors and not adapter.flow.donors.is_donor(ghost)
    assert ghost not in heads  # DonorKV.forget ran, not only the provider's index
    assert [adapter.flow.donors.tokens(d).tolist() for d in state.donors_loaded] == [older]
    assert state.reused_total >= len(doc) - 2 * CONFIG.sink_tokens - 4
    assert check_loaded_kv(h, adapter.flow, target) == state.reused_total
    h.run_until_idle()
    assert runtime.snapshot()["declined"].get("donor_evicted") is None
    check_invariants(h, full_kv=True)
    assert_drained(h)


def test_a_recipient_donates_its_exact_head_and_nothing_after_it_when_not_keeping(
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """With keep_reused_donors off, a request that reused KV publishes only its head before the
    first copied position; that head (cold KV) is indexed as a donor, so a passage first seen
    there is reused by a later request, while the recipient's approximate tail is never
    offered."""
    hooks = installed(dataclasses.replace(CONFIG, keep_reused_donors=False))
    adapter = next(hooks)
    try:
        _recipient_donates_its_head_only(adapter, model_config, passages, instructions)
    finally:
        hooks.close()


def _recipient_donates_its_head_only(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = SglangCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    runtime = adapter.runtime
    doc_a, doc_b = document(passages, 0, 6), document(passages, 1, 4)
    h.submit(instructions[0] + doc_a)
    h.run_until_idle()
    recipient_tokens = instructions[1] + doc_b + doc_a
    recipient = h.submit(recipient_tokens, max_new_tokens=2)
    step_until(h, lambda: materialized(adapter.flow, recipient.rid))
    cap = adapter.flow.requests[recipient.rid].publish_cap
    assert len(instructions[1] + doc_b) <= cap < len(recipient_tokens) - len(doc_a) // 2
    h.run_until_idle()
    assert len(runtime.provider.index) == 2  # the donor, and the recipient's head
    heads = [adapter.flow.donors.tokens(hd) for hd in runtime.provider.index.handles()]
    assert sorted(len(t) for t in heads) == sorted([cap, len(instructions[0] + doc_a)])
    check_invariants(h, full_kv=True)  # the head in the tree holds cold KV

    target = h.submit(instructions[2] + doc_b + instructions[3], max_new_tokens=2)
    step_until(h, lambda: materialized(adapter.flow, target.rid))
    state = adapter.flow.requests[target.rid]
    assert all(len(adapter.flow.donors.tokens(d)) == cap for _, d in state.loaded_pieces)
    assert state.reused_total >= len(doc_b) - 2 * CONFIG.sink_tokens - 2
    assert check_loaded_kv(h, adapter.flow, target) == state.reused_total
    h.run_until_idle()
    check_invariants(h, full_kv=True)
    assert_drained(h)


def test_a_recipient_holds_the_prompt_it_did_not_publish_as_donor_kv(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """A request that reused KV publishes its exact head only; when it finishes, the rest of its
    prompt KV (a passage it computed after the first copied position included) stays in the
    held-donor store, outside the tree, and a later request reuses that passage from it. Under
    memory pressure the store is evicted before the tree, and its donors are forgotten; a reset
    frees it. Every slot stays accounted for (SGLang's idle check included)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = SglangCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    runtime = adapter.runtime
    doc_a, doc_b = document(passages, 0, 6), document(passages, 1, 4)
    h.submit(instructions[0] + doc_a)
    h.run_until_idle()
    recipient_tokens = instructions[1] + doc_a + doc_b
    recipient = h.submit(recipient_tokens, max_new_tokens=2)
    step_until(h, lambda: materialized(adapter.flow, recipient.rid))
    cap = adapter.flow.requests[recipient.rid].publish_cap
    assert cap < len(instructions[1] + doc_a)  # doc_b was computed after the first copy
    h.run_until_idle()
    store = held_of(h.cache)
    assert len(store) == 1
    (handle,) = store.handles()
    entry = store.get(handle)
    assert entry.held_from == cap and entry.held_to == len(recipient_tokens)
    assert adapter.flow.donors.tokens(handle).tolist() == recipient_tokens
    check_invariants(h, full_kv=True)  # the tree holds cold KV only; held slots accounted

    target = h.submit(instructions[2] + doc_b + instructions[3], max_new_tokens=2)
    step_until(h, lambda: materialized(adapter.flow, target.rid))
    state = adapter.flow.requests[target.rid]
    assert state.donors_loaded == frozenset({handle})
    assert state.reused_total >= len(doc_b) - 2 * CONFIG.sink_tokens - 2
    assert check_loaded_kv(h, adapter.flow, target) == state.reused_total
    h.run_until_idle()
    check_invariants(h, full_kv=True)

    assert len(store) == 2  # the target reused KV too: it holds its tail

    # pressure: the store goes first, least recently used first; the tree keeps what it had
    tree_evictable = h.cache.evictable_size() - store.held_tokens
    held_before = store.held_tokens
    freed = h.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted
    assert freed == entry.held_to - entry.held_from == held_before - store.held_tokens
    assert handle not in store and len(store) == 1
    assert h.cache.evictable_size() == tree_evictable + store.held_tokens
    assert not adapter.flow.donors.is_donor(handle)
    check_invariants(h, full_kv=True)
    freed = h.cache.evict(EvictParams(num_tokens=store.held_tokens + 1)).num_tokens_evicted
    assert len(store) == 0 and freed > 0
    check_invariants(h, full_kv=True)

    h.submit(instructions[0] + doc_a)  # doc_a resident again
    h.run_until_idle()
    again = h.submit(instructions[4] + doc_a + doc_b, max_new_tokens=2)
    h.run_until_idle()
    assert again.finished() and len(store) == 1
    h.cache.reset()
    h.allocator.clear()  # what the scheduler's flush does after the tree's reset
    assert len(store) == 0 and len(runtime.provider.index) == 0
    assert h.allocator.available_size() == h.config.pool_tokens
    check_invariants(h)


def test_a_request_that_opts_out_is_never_planned_and_still_donates(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """``custom_params={"semblend_reuse": false}`` (or ``"off"``, or a value it does not know):
    no plan although a donor is resident, one ``declined:opted_out`` outcome per request; its
    own prompt is still a donor for others. ``"on"`` leaves the server's setting."""
    runtime = adapter.runtime
    h = SglangCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    doc, other = document(passages, 0, 8), document(passages, 2, 8)
    h.submit(instructions[0] + doc)
    h.run_until_idle()
    outs = [
        h.submit(instructions[1 + k] + doc, max_new_tokens=2, custom_params={"semblend_reuse": v})
        for k, v in enumerate((False, "off", "maybe"))
    ]
    own = h.submit(instructions[4] + other, custom_params={"semblend_reuse": False})
    h.run_until_idle()
    snap = runtime.snapshot()
    assert all(r.finished() and r.rid not in adapter.flow.requests for r in [*outs, own])
    assert snap["declined"].get(Reason.OPTED_OUT) == 4
    assert snap["outcomes"]["materialized"] == 0 and snap["reused_tokens"] == 0
    later = h.submit(instructions[2] + other, custom_params={"semblend_reuse": "on"})
    h.run_until_idle()
    snap = runtime.snapshot()
    assert later.finished() and snap["outcomes"]["materialized"] == 1, snap["declined"]
    assert snap["reused_tokens"] > len(other) // 2  # from the opted-out request's prompt
    check_invariants(h, full_kv=True)
    assert_drained(h)


def test_cache_reset_forgets_every_donor(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    h.submit(instructions[0] + document(passages, 2, 8))
    h.run_until_idle()
    assert len(adapter.runtime.provider.index) == 1
    # What Scheduler.flush_cache does (the harness is idle: no request holds slots).
    h.cache.reset()
    h.cache.req_to_token_pool.clear()
    h.cache.token_to_kv_pool_allocator.clear()
    assert len(adapter.runtime.provider.index) == 0
    target = h.submit(instructions[5] + document(passages, 2, 8), max_new_tokens=2)
    h.run_until_idle()
    assert target.finished()
    snap = adapter.runtime.snapshot()
    assert snap["outcomes"]["materialized"] == 0 and "donor_evicted" not in snap["declined"]
    check_invariants(h, full_kv=True)


def test_hook_time_is_counted_on_every_request_path_hook(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    runtime = adapter.runtime
    flow = adapter.flow
    calls: dict[str, int] = {}
    real = flow.guarded

    def counting(where: str, *args: Any) -> Any:
        calls[where] = calls.get(where, 0) + 1
        return real(where, *args)

    flow.guarded = counting  # type: ignore[method-assign]
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)  # resets the cache
    target = semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 1, snap
    assert snap["hook_calls"] == sum(calls.values()) > 0
    assert {"reset", "match_prefix", "checkpoint", "release", "load"} <= set(calls), calls
    assert 0 < snap["hook_seconds"] < 60
    assert snap["hook_seconds"] * 1000 >= snap["lookup_ms_mean"] * snap["lookups"]


# ---- install / uninstall (the rest: tests/contract) -----------------------------------------


def test_the_inherited_finish_is_wrapped_and_its_wrapper_deleted_on_unpatch() -> None:
    """``finish`` is BasePrefixCache's: the adapter wraps it on UnifiedRadixCache, and
    unpatching deletes the wrapper rather than installing the inherited method."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    unpatch_radix_cache()
    inherited_finish = UnifiedRadixCache.finish  # BasePrefixCache's: wrapped, then deleted
    assert "finish" not in UnifiedRadixCache.__dict__
    patch_radix_cache(CONFIG)
    assert UnifiedRadixCache.__dict__["finish"].__wrapped__ is inherited_finish
    unpatch_radix_cache()
    assert "finish" not in UnifiedRadixCache.__dict__
    assert UnifiedRadixCache.finish is inherited_finish


# ---- substitute mode ---------------------------------------------------------------------------


def test_substituted_prompt_puts_the_donor_head_before_the_shared_span() -> None:
    from array import array

    from semblend_sglang.align import Span
    from semblend_sglang.namespace import Namespace
    from semblend_sglang.patches.sglang.flow.substitute import substituted_prompt
    from semblend_sglang.plan import ReusePlan

    donor = [7, 7, 7, 1, 2, 3, 4, 5, 6, 9]
    target = array("q", [8, 8, 1, 2, 3, 4, 5, 6, 0, 0, 0])
    plan = ReusePlan(
        donor_handle=1,
        donor_namespace=Namespace(model="m"),
        spans=(Span(target_start=3, donor_start=4, length=5),),  # sink-trimmed: starts at 2
        reused_tokens=5,
        prompt_tokens=len(target),
        exact_len=0,
        page_size=1,
        substitute=True,
    )
    out = substituted_prompt(target, donor, plan)
    assert out is not None and out.typecode == "q"
    assert list(out) == [7, 7, 7, 1, 2, 3, 4, 5, 6, 0, 0, 0]  # donor[:9] + target[8:]
    assert substituted_prompt(target, donor[:6], plan) is None  # donor shorter than its span
    changed = list(donor)
    changed[5] = 99
    assert substituted_prompt(target, changed, plan) is None  # donor no longer matches


def _prefill_steps(h: SglangCacheHarness, req: Any) -> list[int]:
    """Step ``h`` until ``req`` has prefilled its prompt; the end of each of its prefill chunks,
    with invariants checked after every step."""
    ends: list[int] = []
    for _ in range(64):
        report = h.step()
        check_invariants(h)
        if any(r is req for r in report.admitted) or report.chunked is req:
            ends.append(int(req.extend_end))
        if ends and ends[-1] >= len(req.origin_input_ids):
            return ends
    raise AssertionError(f"{req.rid} did not prefill: {ends}")


@pytest.mark.parametrize("logprobs", ["none", "output"])
def test_a_sparse_request_is_charged_at_admission_what_it_computes(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    logprobs: str,
) -> None:
    """chunked_prefill_size 128: a semantic hit of ~500 tokens that computes fewer than 128 is
    one prefill chunk (SGLang's PrefillAdder is charged its computed tokens, not its length),
    also when it asks for output-token logprobs (what SGLang sets ``logprob_start_len`` to
    then: the prompt's length), while a cold request of the same length takes a chunk per 128
    tokens."""
    chunk = 128
    config = HarnessConfig(pool_tokens=8192, chunked_prefill_size=chunk)
    h = SglangCacheHarness(config, model_config)
    target = semantic_pair(h, passages, instructions)
    n = len(target.origin_input_ids)
    if logprobs == "output":
        target.return_logprob = True
        target.logprob_start_len = n
    assert n > 3 * chunk
    assert _prefill_steps(h, target) == [n]  # one chunk
    state = adapter.flow.requests[target.rid]
    # exact prefix + computed positions: at most the chunk budget
    assert 0 < n - state.reused_total <= chunk, (n, state)
    assert check_loaded_kv(h, adapter.flow, target) == state.reused_total
    h.run_until_idle()
    cold = h.submit(document(passages, 5, 8)[:n], max_new_tokens=2)  # shares nothing cached
    assert len(_prefill_steps(h, cold)) == -(-n // chunk)
    h.run_until_idle()
    check_invariants(h, full_kv=True)
    assert_drained(h)


@pytest.mark.parametrize("chunk", [64, 512])
def test_randomized_traffic_keeps_every_invariant_at_small_and_large_chunks(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    chunk: int,
) -> None:
    """The randomized semantic traffic with the admission charged computed tokens: a sparse
    request split into chunks is a valid sparse extend in each, and the publish cap holds."""
    harness = SglangCacheHarness(
        HarnessConfig(pool_tokens=6144, chunked_prefill_size=chunk, max_running_requests=8),
        model_config,
    )
    counts = drive_random(harness, passages, instructions, 260, seed=23)
    snap = adapter.runtime.snapshot()
    print(f"chunk {chunk}: {harness.stats} {counts} {snap['outcomes']} {snap['declined']}")
    assert snap["outcomes"]["materialized"] >= 20, snap
    assert Reason.UNREPORTED not in snap["declined"], snap
    assert snap["outcomes"]["cold_fallback"] == 0 and snap["errors"] == {}, snap
    if chunk == 64:
        assert counts["chunked"] >= 5, counts
    assert not adapter.flow.requests, "request state leaked past release"
    assert_drained(harness)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_randomized_traffic_keeps_every_invariant_with_pages(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    page: int,
) -> None:
    """``--page-size`` 16 and 64: every page has one owner after every step (free list, tree,
    live requests, held donors, the held store holding whole pages only), the tree holds only
    cold KV, and semantic hits still happen (plans are page-aligned, spans copied per token)."""
    harness = SglangCacheHarness(
        HarnessConfig(
            page_size=page, pool_tokens=8192, chunked_prefill_size=256, max_running_requests=8
        ),
        model_config,
    )
    counts = drive_random(harness, passages, instructions, 200, seed=31 + page, retract=True)
    snap = adapter.runtime.snapshot()
    print(f"page {page}: {harness.stats} {counts} {snap['outcomes']} {snap['declined']}")
    assert snap["outcomes"]["materialized"] >= 10, snap
    assert snap["held_donors"]["kept"] >= 1, snap["held_donors"]
    assert Reason.UNREPORTED not in snap["declined"], snap
    assert Reason.UNSUPPORTED_CACHE not in snap["declined"], snap
    assert snap["outcomes"]["cold_fallback"] == 0 and snap["errors"] == {}, snap
    assert not adapter.flow.requests, "request state leaked past release"
    assert_drained(harness)
