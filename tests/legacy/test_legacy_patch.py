"""The legacy adapter (sglang 0.5.15 `RadixCache`) at cache level, with semblend's hooks installed.

The legacy counterpart of tests/test_sglang_patch.py, on tests/legacy/legacy_harness.py (real
`RadixCache`, pools, allocator, `PrefillAdder`, `ScheduleBatch` on CPU): the materialized KV
against the torch reference, the safety invariants over a randomized run with semantic reuse,
eviction and aborts, the fault paths (provider, kernel, evicted donor, donor in host memory),
install/uninstall, the spawn plugin, substitute mode, and adapter selection by version. Skipped
unless the installed sglang is a legacy version (`make test-legacy`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from legacy_support import legacy_skip_reason, use_triton_interpreter

_SKIP = legacy_skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)
use_triton_interpreter()

import torch  # noqa: E402
from legacy_harness import HarnessConfig, LegacyCacheHarness, check_invariants  # noqa: E402
from test_legacy_harness import drive_random  # noqa: E402
from test_sglang_harness import (  # noqa: E402  fixtures of the 0.5.23 tests
    _assert_drained,
    instructions,
    model_config,
    passages,
)
from test_sglang_patch import _document, _semantic_pair  # noqa: E402  harness-agnostic

from semblend_sglang.config import Config  # noqa: E402
from semblend_sglang.kernels import rotate_k  # noqa: E402
from semblend_sglang.patches.sglang import (  # noqa: E402
    installed_adapter,
    patch_radix_cache,
    unpatch_radix_cache,
)
from semblend_sglang.patches.sglang.legacy import LegacyRadixCacheAdapter  # noqa: E402
from semblend_sglang.patches.sglang.runtime import ReuseState  # noqa: E402

__all__ = ["instructions", "model_config", "passages"]  # re-exported fixtures

CONFIG = Config(min_prompt_tokens=64, min_reuse_tokens=32, min_reuse_ratio=0.2)


@pytest.fixture
def adapter() -> Iterator[Any]:
    unpatch_radix_cache()
    installed = patch_radix_cache(CONFIG)
    assert isinstance(installed, LegacyRadixCacheAdapter)
    try:
        yield installed
    finally:
        unpatch_radix_cache()


def _step_until(h: LegacyCacheHarness, done: Any, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if done():
            return
        h.step()
        check_invariants(h)
    raise AssertionError("condition not reached")


def _materialized(runtime: Any, rid: str) -> bool:
    state = runtime.requests.get(rid)
    return state is not None and state.state is ReuseState.MATERIALIZED


def _donor_path(h: LegacyCacheHarness, tokens: list[int]) -> torch.Tensor:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    found = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    return found.device_indices.to(torch.int64)


def _check_loaded_kv(h: LegacyCacheHarness, runtime: Any, req: Any) -> int:
    """tests/test_sglang_patch.py `_check_loaded_kv` on the legacy tree: every copied piece of
    ``req`` holds its donor's K rotated by the piece's shift (torch reference) and the donor's V,
    in slots only the request owns; returns the tokens checked. Marks them dirty."""
    state = runtime.requests[req.rid]
    row = h.req_to_token_pool.req_to_token[req.req_pool_idx]
    spec = runtime.rope_spec(None)
    checked = 0
    for span, donor in state.loaded_pieces:
        dst = row[span.target_start : span.target_end].to(torch.int64)
        path = _donor_path(h, runtime.donor_tokens(donor)[: span.donor_end].tolist())
        assert path.numel() == span.donor_end  # the copied positions were all resident
        src = path[span.donor_start : span.donor_end]
        assert not set(src.tolist()) & set(dst.tolist())
        deltas = torch.full((dst.numel(),), span.delta, dtype=torch.int64)
        for layer in range(h.config.num_layers):
            k = h.kv_pool.k_buffer[layer]
            v = h.kv_pool.v_buffer[layer]
            expected_k = rotate_k(k[src], deltas, spec, backend="torch")
            torch.testing.assert_close(k[dst], expected_k, rtol=0, atol=0)
            assert torch.equal(v[dst], v[src])
        h.mark_dirty(dst)
        checked += span.length
    return checked


def test_materialized_slots_hold_the_donors_kv_rotated_by_the_shift(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = LegacyCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    doc = _document(passages, 0, 8)
    donor_tokens = instructions[0] + doc
    donor = h.submit(donor_tokens)
    h.run_until_idle()
    target_tokens = instructions[4] + instructions[2] + doc
    target = h.submit(target_tokens, max_new_tokens=2)
    runtime = adapter.runtime
    steps = 0

    def done() -> bool:
        nonlocal steps
        steps += 1
        return _materialized(runtime, target.rid)

    _step_until(h, done)
    # one pass per 256-token chunk, as for a cold prompt: no chunk cut at the span, no second phase
    chunks = -(-len(target_tokens) // 256)
    assert steps - 1 == chunks
    state = runtime.requests[target.rid]
    shift = len(instructions[4] + instructions[2]) - len(instructions[0])
    assert {span.delta for span, _ in state.loaded_pieces} == {shift}
    # each chunk computes its last position: one token per chunk is not reused
    assert state.reused_total >= len(doc) - 2 * CONFIG.sink_tokens - chunks
    # the tree owns the exact head only; the rest of the row is the request's
    assert int(target.cache_protected_len) <= state.publish_cap
    assert _check_loaded_kv(h, runtime, target) == state.reused_total
    h.run_until_idle()
    assert target.finished() and donor.finished()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 1
    assert snap["reused_tokens"] == state.reused_total
    assert snap["reused_donors"] == 1 and snap["reused_spans"] == state.spans_loaded
    # reuse at any offset is not client-visible: SGLang's count covers the exact prefix only
    assert target.cached_tokens < len(instructions[4])
    check_invariants(h, full_kv=True)
    _assert_drained(h)  # type: ignore[arg-type]


def test_first_copy_at_a_chunk_start_and_inside_a_chunk_publish_the_same_exact_head(
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """The publish cap c (first copied position) inside the chunk that copies (the head
    [prefix, c) computed in the same pass: cache_unfinished_req inserts T[0:c) itself), and c at
    the start of a chunk (the previous chunk already published T[0:c): nothing more is
    inserted). Both leave exactly T[0:c) in the tree, the tree locked at c, and the request's
    own slots after it."""
    target_tokens = instructions[2] + _document(passages, 5, 6)

    def run(chunk: int) -> tuple[LegacyCacheHarness, Any, Any]:
        unpatch_radix_cache()
        adapter = patch_radix_cache(CONFIG)
        h = LegacyCacheHarness(
            HarnessConfig(pool_tokens=8192, chunked_prefill_size=chunk), model_config
        )
        h.submit(instructions[0] + _document(passages, 5, 6))
        h.run_until_idle()
        target = h.submit(target_tokens, max_new_tokens=2)
        runtime = adapter.runtime  # type: ignore[union-attr]
        _step_until(h, lambda: _materialized(runtime, target.rid))
        state = runtime.requests[target.rid]
        cap = state.publish_cap
        assert int(target.cache_protected_len) == cap  # the tree holds T[0:c), locked at c
        assert _donor_path(h, target_tokens).numel() == cap
        assert _check_loaded_kv(h, runtime, target) == state.reused_total
        h.run_until_idle()
        check_invariants(h, full_kv=True)
        assert _donor_path(h, target_tokens).numel() == cap  # still: nothing after c published
        _assert_drained(h)  # type: ignore[arg-type]
        return h, target, state

    try:
        _, _, state = run(256)
        cap, exact = state.publish_cap, state.plan.exact_len
        assert exact < cap < exact + 256  # the first copy inside the first chunk
        _, _, state = run(cap - exact)  # the first chunk ends exactly at c
        assert state.publish_cap == cap
    finally:
        unpatch_radix_cache()


def test_exact_repeat_after_a_semantic_hit_is_not_served_from_reused_kv(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = LegacyCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    doc = _document(passages, 1, 8)
    h.submit(instructions[1] + doc)
    h.run_until_idle()
    target_tokens = instructions[3] + doc
    first = h.submit(target_tokens)
    h.run_until_idle()
    assert adapter.runtime.provider.snapshot()["outcomes"]["materialized"] == 1
    repeat = h.submit(target_tokens)
    h.step()
    # the exact hit stops where the semantic hit's own head ended: nothing after it was published
    assert 0 < repeat.cached_tokens < len(instructions[3]) + 2 * CONFIG.sink_tokens
    h.run_until_idle()
    check_invariants(h, full_kv=True)  # check_exact_match ran on the repeat's match
    assert first.finished() and repeat.finished()
    _assert_drained(h)  # type: ignore[arg-type]


def test_randomized_semantic_traffic_keeps_every_invariant(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    harness = LegacyCacheHarness(
        HarnessConfig(pool_tokens=6144, chunked_prefill_size=256, max_running_requests=8),
        model_config,
    )
    counts = drive_random(harness, passages, instructions, 520, seed=7)
    snap = adapter.runtime.provider.snapshot()
    print(f"legacy semantic run: {harness.stats} {counts} {snap['outcomes']} {snap['declined']}")
    assert snap["outcomes"]["materialized"] >= 60, snap  # 129 measured (seed 7)
    assert snap["reused_spans"] > snap["outcomes"]["materialized"], snap  # several-span plans
    assert snap["multi_donor_requests"] >= 1, snap
    assert "unreported" not in snap["declined"], snap  # every plan's outcome was recorded
    assert snap["outcomes"]["cold_fallback"] == 0, snap
    assert snap["errors"] == {}, snap
    assert counts["aborted"] >= 3 and counts["chunked"] >= 5, counts
    assert harness.stats["evicted_steps"] >= 10, harness.stats
    assert not adapter.runtime.requests, "request state leaked past release"
    _assert_drained(harness)  # type: ignore[arg-type]


# ---- faults ----------------------------------------------------------------------------------


def test_request_aborted_while_waiting_after_its_lookup_leaves_no_state(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """0.5.15's abort_request pops a waiting request without touching the cache; the adapter's
    abort_request hook drops its plan (declined as aborted)."""
    h = LegacyCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    runtime = adapter.runtime
    target = _semantic_pair(h, passages, instructions)
    target.init_next_round_input(h.cache)  # the lookup of a waiting request
    assert target.rid in runtime.requests
    h.abort(target)  # through the real Scheduler.abort_request
    assert target.rid not in runtime.requests and target.rid not in runtime.settled
    snap = runtime.provider.snapshot()
    assert snap["declined"] == {"no_donor": 1, "aborted": 1}, snap  # the donor, the target
    assert snap["hook_calls"] > 0 and snap["hook_seconds"] > 0
    h.run_until_idle()
    check_invariants(h, full_kv=True)
    _assert_drained(h)  # type: ignore[arg-type]


def test_provider_error_falls_back_cold(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = LegacyCacheHarness(HarnessConfig(pool_tokens=4096), model_config)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("index corrupted")

    monkeypatch.setattr(adapter.runtime.provider, "_decide", broken)
    target = _semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished() and target.cached_tokens == 0
    snap = adapter.runtime.provider.snapshot()
    assert snap["outcomes"]["cold_fallback"] >= 1 and snap["outcomes"]["materialized"] == 0
    check_invariants(h, full_kv=True)
    _assert_drained(h)  # type: ignore[arg-type]


def test_kernel_error_falls_back_cold_without_leaking_slots(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import semblend_sglang.kernels as kernels

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(kernels, "transfer_kv_sglang", broken)
    h = LegacyCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    target = _semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished()
    snap = adapter.runtime.provider.snapshot()
    assert snap["outcomes"]["cold_fallback"] == 1, snap
    assert snap["errors"] == {"load": 1}, snap
    check_invariants(h, full_kv=True)
    _assert_drained(h)  # type: ignore[arg-type]


def test_donor_evicted_between_lookup_and_copy_is_declined(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = LegacyCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    runtime = adapter.runtime
    evicted: list[str] = []

    def evict_after_lookup(harness: LegacyCacheHarness, req: Any) -> None:
        # between the request's lookup (its match) and the copy (in prepare_for_extend)
        if req.rid in runtime.requests and not evicted:
            evicted.append(req.rid)
            harness.cache.evict(EvictParams(num_tokens=harness.config.pool_tokens))

    h.match_hook = evict_after_lookup
    target = _semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert evicted == [target.rid]
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["declined"].get("donor_evicted") == 1, snap
    assert snap["outcomes"]["materialized"] == 0
    assert len(runtime.provider.index) == 1  # the evicted donor was forgotten; target registered
    check_invariants(h, full_kv=True)
    _assert_drained(h)  # type: ignore[arg-type]


def test_passages_from_two_donors_and_one_evicted_before_the_copy(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """A plan that takes passages from two donors; the first time, one donor's KV is evicted
    between the lookup and the copy: only its spans are computed, the other donor's are reused.
    The next such request reuses from both (B's passages from the target's exact head), in one
    pass."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    h = LegacyCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    runtime = adapter.runtime
    first, second = _document(passages, 4, 4), [t for p in passages[4][4:8] for t in p]
    donor_a = instructions[0] + first + instructions[2]
    donor_b = instructions[1] + second + instructions[3]
    for tokens in (donor_a, donor_b):
        h.submit(tokens)
        h.run_until_idle()
    evicted: list[str] = []

    def evict_donor_b(harness: LegacyCacheHarness, req: Any) -> None:
        if req.rid in runtime.requests and not evicted:
            evicted.append(req.rid)
            keep = harness.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", donor_a))))
            harness.cache.inc_lock_ref(keep.last_device_node)  # donor A stays resident
            harness.cache.evict(EvictParams(num_tokens=harness.config.pool_tokens))
            harness.cache.dec_lock_ref(keep.last_device_node)

    h.match_hook = evict_donor_b
    target = h.submit(instructions[5] + second + instructions[4] + first, max_new_tokens=2)
    _step_until(h, lambda: _materialized(runtime, target.rid))
    state = runtime.requests[target.rid]
    assert evicted == [target.rid]
    assert len(state.plan.donors) == 2  # the plan took a span from each donor
    assert len(state.donors_loaded) == 1  # donor B's spans were computed instead
    assert _check_loaded_kv(h, runtime, target) == state.reused_total
    assert state.reused_total >= len(first) - 2 * CONFIG.sink_tokens - 3
    h.run_until_idle()
    assert target.finished()
    check_invariants(h, full_kv=True)

    h.match_hook = None
    # the target computed B's passages before its first copied position: that exact head is in
    # the tree and indexed as a donor
    assert runtime.requests.get(target.rid) is None
    again = h.submit(instructions[3] + first + instructions[1] + second, max_new_tokens=2)
    _step_until(h, lambda: _materialized(runtime, again.rid))
    state = runtime.requests[again.rid]
    assert len(state.donors_loaded) == 2  # one pass copied spans of both donors
    assert state.reused_total >= len(first) + len(second) - 4 * CONFIG.sink_tokens - 6
    assert _check_loaded_kv(h, runtime, again) == state.reused_total
    h.run_until_idle()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 2, snap
    assert snap["multi_donor_requests"] == 1, snap
    check_invariants(h, full_kv=True)
    _assert_drained(h)  # type: ignore[arg-type]


def test_reordered_passages_reuse_every_span_with_its_own_shift(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    runtime = adapter.runtime
    h = LegacyCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    first, second = _document(passages, 3, 4), [t for p in passages[3][4:8] for t in p]
    h.submit(instructions[0] + first + second)
    h.run_until_idle()
    target_tokens = instructions[1] + second + instructions[3] + first
    target = h.submit(target_tokens, max_new_tokens=2)
    _step_until(h, lambda: _materialized(runtime, target.rid))
    state = runtime.requests[target.rid]
    assert len(state.spans) == 2
    shifts = {span.delta for span, _ in state.loaded_pieces}
    assert len(shifts) == 2  # the two passages moved by different shifts
    first_piece = min(state.loaded_pieces, key=lambda p: p[0].target_start)[0]
    last_piece = max(state.loaded_pieces, key=lambda p: p[0].target_start)[0]
    assert first_piece.donor_start > last_piece.donor_start  # in the other order than the donor
    assert _check_loaded_kv(h, runtime, target) == state.reused_total
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 1
    assert snap["reused_tokens"] == state.reused_total
    chunks = -(-len(target_tokens) // 256)
    assert state.reused_total >= len(first) + len(second) - 4 * CONFIG.sink_tokens - chunks
    check_invariants(h, full_kv=True)
    _assert_drained(h)  # type: ignore[arg-type]


def test_donor_in_host_memory_is_kept_and_used_after_load_back_mock_host_tier(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HiRadixCache's host pool needs CUDA, so this CPU test fakes the host tier: the donor
    match reports part of the donor's span as host-resident (device_indices cut short,
    host_hit_length the rest), as HiRadixCache.match_prefix does for a path evicted to host
    memory. The plan is declined as donor_on_host, the donor is kept, and once the path is
    device-resident again (SGLang's own load-back) the next request materializes from it."""
    h = LegacyCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    runtime = adapter.runtime
    real = type(adapter)._donor_match

    def host_resident(self: Any, cache: Any, params: Any) -> Any:
        found = real(self, cache, params)
        on_device = len(found.device_indices)
        moved = on_device // 2
        return found._replace(
            device_indices=found.device_indices[: on_device - moved], host_hit_length=moved
        )

    monkeypatch.setattr(type(adapter), "_donor_match", host_resident)
    target = _semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["declined"].get("donor_on_host") == 1, snap
    assert snap["outcomes"]["materialized"] == 0
    assert len(runtime.provider.index) == 2  # donor kept, target registered
    check_invariants(h, full_kv=True)

    monkeypatch.setattr(type(adapter), "_donor_match", real)  # back on the device
    doc = _document(passages, 2, 8)
    again = h.submit(instructions[3] + doc, max_new_tokens=2)
    h.run_until_idle()
    assert again.finished()
    assert runtime.provider.snapshot()["outcomes"]["materialized"] == 1
    check_invariants(h, full_kv=True)
    _assert_drained(h)  # type: ignore[arg-type]


# ---- modes -------------------------------------------------------------------------------------


def test_discovery_only_looks_up_and_leaves_sglang_unchanged(
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    unpatch_radix_cache()
    adapter = patch_radix_cache(
        Config(mode="discovery_only", min_prompt_tokens=64, min_reuse_tokens=32)
    )
    try:
        h = LegacyCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
        target = _semantic_pair(h, passages, instructions)
        h.run_until_idle()
        assert target.finished() and target.cached_tokens == 0
        snap = adapter.runtime.provider.snapshot()  # type: ignore[union-attr]
        assert snap["outcomes"]["discovery_only"] == 1, snap
        assert snap["outcomes"]["materialized"] == 0
        check_invariants(h, full_kv=True)
        _assert_drained(h)  # type: ignore[arg-type]
    finally:
        unpatch_radix_cache()


class _SchedulerView:
    """The attributes `_substitute` reads from a Scheduler (tree_cache, model_config,
    max_req_input_len)."""

    def __init__(self, h: LegacyCacheHarness) -> None:
        self.tree_cache = h.cache
        self.model_config = h.model_config
        self.max_req_input_len = h.config.max_context_len - 1


def test_substitute_mode_serves_the_donor_head_from_the_exact_cache(
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    unpatch_radix_cache()
    config = Config(
        mode="substitute",
        exact_materialization_only=False,
        embedder="jaccard",  # the token-chunk sketch: no model needed for the gate
        min_similarity=0.3,
        min_prompt_tokens=64,
        min_reuse_tokens=32,
    )
    adapter = patch_radix_cache(config)
    assert isinstance(adapter, LegacyRadixCacheAdapter)
    try:
        h = LegacyCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
        doc = _document(passages, 3, 8)
        donor_tokens = instructions[0] + doc
        h.submit(donor_tokens)
        h.run_until_idle()
        target = h.submit(instructions[2] + doc, max_new_tokens=2)
        h.waiting_queue.remove(target)
        adapter._substitute(_SchedulerView(h), target)
        h.waiting_queue.append(target)
        snap = adapter.runtime.provider.snapshot()
        if snap["outcomes"]["materialized"] != 1:
            pytest.fail(f"substitute did not apply: {snap}")
        assert list(target.origin_input_ids[: len(instructions[0])]) == instructions[0]
        h.step()
        assert target.cached_tokens >= len(donor_tokens) - 2 * config.sink_tokens - 1
        h.run_until_idle()
        assert target.finished()
        check_invariants(h, full_kv=True)  # everything in the tree is exact for what ran
        _assert_drained(h)  # type: ignore[arg-type]
    finally:
        unpatch_radix_cache()


# ---- install / uninstall / selection ---------------------------------------------------------


def _hooked() -> list[tuple[type, str]]:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    return [
        (RadixCache, "match_prefix"),
        (HiRadixCache, "match_prefix"),
        (RadixCache, "cache_unfinished_req"),
        (RadixCache, "cache_finished_req"),
        (ScheduleBatch, "prepare_for_extend"),
        (ForwardBatch, "init_new"),
        (TorchNativeAttnBackend, "forward_extend"),
        (TorchNativeAttnBackend, "_run_sdpa_forward_extend"),
        (Scheduler, "abort_request"),
        (Scheduler, "_add_request_to_queue"),
        (Scheduler, "get_internal_state"),
    ]


def _function(method: Any) -> Any:
    """The function behind a class attribute (a classmethod's or bound method's ``__func__``)."""
    return getattr(method, "__func__", method)


def test_patch_is_idempotent_and_unpatch_restores_the_originals() -> None:
    unpatch_radix_cache()
    names = _hooked()
    originals = {key: key[0].__dict__[key[1]] for key in names}
    first = patch_radix_cache(CONFIG)
    assert isinstance(first, LegacyRadixCacheAdapter)
    assert patch_radix_cache(CONFIG) is first is installed_adapter()
    for owner, name in names:
        assert owner.__dict__[name] is not originals[(owner, name)], (owner, name)
        wrapped = _function(owner.__dict__[name]).__wrapped__
        assert _function(wrapped) is _function(originals[(owner, name)]), (owner, name)
    unpatch_radix_cache()
    unpatch_radix_cache()
    assert installed_adapter() is None
    for owner, name in names:
        assert owner.__dict__[name] is originals[(owner, name)]


def test_the_installed_version_selects_the_legacy_adapter_and_only_it() -> None:
    from packaging.version import Version

    from semblend_sglang.patches.sglang import _adapters
    from semblend_sglang.patches.sglang.adapter import installed_sglang_version

    version = installed_sglang_version()
    assert version is not None
    serving = [cls.__name__ for cls in _adapters() if cls.supports(version)]
    assert serving == ["LegacyRadixCacheAdapter"], (version, serving)
    for v, served in [("0.5.14", False), ("0.5.15", True), ("0.5.15.post1", True),
                      ("0.5.18", True), ("0.5.19", False), ("0.5.20", False)]:  # fmt: skip
        assert LegacyRadixCacheAdapter.supports(Version(v)) is served, v


def test_plugin_patches_a_process_started_with_spawn(tmp_path: Any) -> None:
    code = (
        "import multiprocessing as mp\n"
        "def child(q):\n"
        "    from semblend_sglang.cpu_runtime import ensure_torchvision_importable\n"
        "    ensure_torchvision_importable()\n"
        "    from sglang.srt.plugins import load_plugins\n"
        "    load_plugins()\n"
        "    from sglang.srt.mem_cache.radix_cache import RadixCache as R\n"
        "    q.put(hasattr(R.__dict__['match_prefix'], '__wrapped__'))\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn')\n"
        "    q = ctx.Queue()\n"
        "    p = ctx.Process(target=child, args=(q,))\n"
        "    p.start(); print('patched', q.get(timeout=240)); p.join(60)\n"
    )
    script = tmp_path / "spawn_plugin.py"
    script.write_text(code)
    results = {}
    for enabled in ("1", "0"):
        env = dict(os.environ, SEMBLEND_ENABLED=enabled)
        out = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        results[enabled] = out.stdout.strip()
    assert results == {"1": "patched True", "0": "patched False"}
