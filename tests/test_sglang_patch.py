"""The SGLang 0.5.23 patch at cache level: real UnifiedRadixCache, pools, allocator, PrefillAdder
and ScheduleBatch on CPU (tests/sglang_harness.py), with semblend's hooks installed.

Checks the materialized KV against the torch reference, the safety invariants over a randomized
run with semantic reuse, eviction and aborts, and the fault paths (provider, kernel, evicted
donor): every request completes, nothing leaks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang_harness import HarnessConfig, SglangCacheHarness, check_invariants
from test_sglang_harness import (  # fixtures and drivers of the vanilla harness tests
    _assert_drained,
    _drive_random,
    instructions,
    model_config,
    passages,
)

from semblend_sglang.config import Config
from semblend_sglang.kernels import rotate_k
from semblend_sglang.patches.sglang import (
    installed_adapter,
    patch_radix_cache,
    unpatch_radix_cache,
)

__all__ = ["instructions", "model_config", "passages"]  # re-exported fixtures

CONFIG = Config(min_prompt_tokens=64, min_reuse_tokens=32, min_reuse_ratio=0.2)


def _installed(config: Config) -> Iterator[Any]:
    unpatch_radix_cache()
    installed = patch_radix_cache(config)
    assert installed is not None
    try:
        yield installed
    finally:
        unpatch_radix_cache()


@pytest.fixture
def adapter() -> Iterator[Any]:
    yield from _installed(CONFIG)


def _document(passages: list[list[list[int]]], essay: int, count: int) -> list[int]:
    return [t for p in passages[essay][:count] for t in p]


def _step_until(h: SglangCacheHarness, done: Any, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if done():
            return
        h.step()
        check_invariants(h)
    raise AssertionError("condition not reached")


def test_materialized_slots_hold_the_donors_kv_rotated_by_the_shift(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    doc = _document(passages, 0, 8)
    donor_tokens = instructions[0] + doc
    donor = h.submit(donor_tokens)
    h.run_until_idle()
    target_tokens = instructions[4] + instructions[2] + doc
    target = h.submit(target_tokens, max_new_tokens=2)
    runtime = adapter.runtime
    _step_until(
        h,
        lambda: (
            runtime.requests.get(target.rid) is not None
            and runtime.requests[target.rid].phase == "materialized"
        ),
    )
    state = runtime.requests[target.rid]
    assert state.delta == len(instructions[4] + instructions[2]) - len(instructions[0])
    assert state.reused_tokens >= len(doc) - 2 * CONFIG.sink_tokens - 1
    assert target.prefix_len >= state.end  # the next chunk started after the reused span

    row = h.req_to_token_pool.req_to_token[target.kv.req_pool_idx]
    dst = row[state.boundary : state.end].to(torch.int64)
    donor_row_tokens = donor_tokens[: state.donor_start + state.reused_tokens]
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    match = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", donor_row_tokens))))
    path = h.cache.path_device_indices(match.last_device_node)
    src = path[state.donor_start : state.donor_start + state.reused_tokens].to(torch.int64)
    assert not set(src.tolist()) & set(dst.tolist())
    spec = runtime.rope_spec(None)
    deltas = torch.full((dst.numel(),), state.delta, dtype=torch.int64)
    for layer in range(h.config.num_layers):
        k = h.kv_pool.k_buffer[layer]
        v = h.kv_pool.v_buffer[layer]
        expected_k = rotate_k(k[src], deltas, spec, backend="torch")
        torch.testing.assert_close(k[dst], expected_k, rtol=0, atol=0)
        assert torch.equal(v[dst], v[src])
    h.mark_dirty(dst)
    h.run_until_idle()
    assert target.finished() and donor.finished()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 1
    assert snap["reused_tokens"] == state.reused_tokens
    assert target.cached_tokens >= state.reused_tokens  # SGLang itself reports the reuse
    check_invariants(h, full_kv=True)
    _assert_drained(h)


def test_exact_repeat_after_a_semantic_hit_is_not_served_from_reused_kv(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
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
    assert 0 < repeat.prefix_len < len(instructions[3]) + 2 * CONFIG.sink_tokens
    h.run_until_idle()
    check_invariants(h, full_kv=True)  # check_exact_match ran on the repeat's match
    assert first.finished() and repeat.finished()
    _assert_drained(h)


def test_randomized_semantic_traffic_keeps_every_invariant(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    harness = SglangCacheHarness(
        HarnessConfig(pool_tokens=6144, chunked_prefill_size=256, max_running_requests=8),
        model_config,
    )
    counts = _drive_random(harness, passages, instructions, 520, seed=7)
    snap = adapter.runtime.provider.snapshot()
    print(f"semantic run: {harness.stats} {counts} {snap['outcomes']} {snap['declined']}")
    assert snap["outcomes"]["materialized"] >= 30, snap  # 37 measured with this seed
    assert snap["outcomes"]["cold_fallback"] == 0, snap
    assert snap["errors"] == {}, snap
    assert counts["aborted"] >= 3 and counts["chunked"] >= 5, counts
    assert harness.stats["evicted_steps"] >= 10, harness.stats
    assert not adapter.runtime.requests, "request state leaked past release"
    _assert_drained(harness)


MULTI_SPAN = Config(
    min_prompt_tokens=64,
    min_reuse_tokens=32,
    min_reuse_ratio=0.2,
    strict_prefix_boundary=False,
    max_spans=8,
)


@pytest.fixture
def multi_span_adapter() -> Iterator[Any]:
    yield from _installed(MULTI_SPAN)


def test_reordered_passages_reuse_every_span_with_its_own_shift(
    multi_span_adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    runtime = multi_span_adapter.runtime
    h = SglangCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    first, second = _document(passages, 3, 4), [t for p in passages[3][4:8] for t in p]
    donor_tokens = instructions[0] + first + second
    h.submit(donor_tokens)
    h.run_until_idle()
    target_tokens = instructions[1] + second + instructions[3] + first
    target = h.submit(target_tokens, max_new_tokens=2)
    checked: list[tuple[int, int, int, int]] = []  # (boundary, end, donor_start, delta) per span

    def span_done() -> bool:
        state = runtime.requests[target.rid]  # KeyError: the plan was dropped
        done = state.index if state.phase == "head" else state.index + 1
        if state.reused_any and len(checked) < done:
            for span in state.spans[len(checked) : done]:
                checked.append((span.target_start, span.target_end, span.donor_start, span.delta))
                row = h.req_to_token_pool.req_to_token[target.kv.req_pool_idx]
                dst = row[span.target_start : span.target_end].to(torch.int64)
                key = RadixKey(array("q", donor_tokens[: span.donor_start + span.length]))
                match = h.cache.match_prefix(MatchPrefixParams(key=key))
                path = h.cache.path_device_indices(match.last_device_node)
                src = path[span.donor_start : span.donor_start + span.length].to(torch.int64)
                deltas = torch.full((dst.numel(),), span.delta, dtype=torch.int64)
                spec = runtime.rope_spec(None)
                for layer in (0, h.config.num_layers - 1):
                    k = h.kv_pool.k_buffer[layer]
                    torch.testing.assert_close(
                        k[dst], rotate_k(k[src], deltas, spec, backend="torch"), rtol=0, atol=0
                    )
                    assert torch.equal(
                        h.kv_pool.v_buffer[layer][dst], h.kv_pool.v_buffer[layer][src]
                    )
                h.mark_dirty(dst)
        return state.phase == "materialized"

    _step_until(h, lambda: target.rid in runtime.requests)
    _step_until(h, span_done)
    state = runtime.requests[target.rid]
    assert len(state.spans) == 2 and len(checked) == 2
    assert checked[0][3] != checked[1][3]  # the two passages moved by different shifts
    assert checked[0][2] > checked[1][2]  # and in the other order than in the donor
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 1
    assert snap["reused_tokens"] == state.reused_total == sum(e - b for b, e, _, _ in checked)
    assert state.reused_total >= len(first) + len(second) - 4 * MULTI_SPAN.sink_tokens
    assert target.cached_tokens >= state.reused_total
    check_invariants(h, full_kv=True)
    _assert_drained(h)


def test_randomized_multi_span_traffic_keeps_every_invariant(
    multi_span_adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    harness = SglangCacheHarness(
        HarnessConfig(pool_tokens=6144, chunked_prefill_size=256, max_running_requests=8),
        model_config,
    )
    counts = _drive_random(harness, passages, instructions, 300, seed=11)
    snap = multi_span_adapter.runtime.provider.snapshot()
    print(f"multi-span run: {harness.stats} {counts} {snap['outcomes']} {snap['declined']}")
    assert snap["outcomes"]["materialized"] >= 15, snap
    assert snap["outcomes"]["cold_fallback"] == 0 and snap["errors"] == {}, snap
    assert not multi_span_adapter.runtime.requests, "request state leaked past release"
    _assert_drained(harness)


# ---- faults ----------------------------------------------------------------------------------


def _semantic_pair(
    h: SglangCacheHarness, passages: list[list[list[int]]], instructions: list[list[int]]
) -> Any:
    doc = _document(passages, 2, 8)
    h.submit(instructions[0] + doc)
    h.run_until_idle()
    return h.submit(instructions[5] + doc, max_new_tokens=2)


def test_provider_error_falls_back_cold(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("index corrupted")

    monkeypatch.setattr(adapter.runtime.provider, "_decide", broken)
    target = _semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished() and target.cached_tokens == 0
    snap = adapter.runtime.provider.snapshot()
    assert snap["outcomes"]["cold_fallback"] >= 1 and snap["outcomes"]["materialized"] == 0
    check_invariants(h, full_kv=True)
    _assert_drained(h)


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
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    target = _semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished()
    snap = adapter.runtime.provider.snapshot()
    assert snap["outcomes"]["cold_fallback"] == 1, snap
    assert snap["errors"] == {"checkpoint": 1}, snap
    check_invariants(h, full_kv=True)
    _assert_drained(h)


def test_donor_evicted_between_lookup_and_copy_is_declined(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    target = _semantic_pair(h, passages, instructions)
    runtime = adapter.runtime
    _step_until(
        h,
        lambda: (
            runtime.requests.get(target.rid) is not None
            and runtime.requests[target.rid].phase == "head"
        ),
    )
    h.cache.evict(EvictParams(num_tokens=h.config.pool_tokens))  # the donor is unlocked: gone
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["declined"].get("donor_evicted") == 1, snap
    assert snap["outcomes"]["materialized"] == 0
    assert len(runtime.provider.index) == 1  # the evicted donor was forgotten; target registered
    check_invariants(h, full_kv=True)
    _assert_drained(h)


def test_donor_in_host_memory_is_kept_and_used_after_load_back_mock_host_tier(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HiCache's host pool needs CUDA (cudaHostRegister), so this CPU test fakes the host tier:
    the donor match reports part of the donor's span as host-resident (host_hit_length), as
    UnifiedRadixCache does for a path evicted to host memory. The plan is declined as
    donor_on_host, the donor is kept, and once the path is device-resident again (what SGLang's
    own load-back does) the next request materializes from it."""
    h = SglangCacheHarness(HarnessConfig(pool_tokens=8192), model_config)
    runtime = adapter.runtime
    real = type(adapter)._donor_match

    def host_resident(cache: Any, params: Any, orig_match: Any) -> Any:
        found = real(cache, params, orig_match)
        moved = int(found.device_prefix_len) // 2
        return found._replace(
            device_prefix_len=int(found.device_prefix_len) - moved, host_hit_length=moved
        )

    monkeypatch.setattr(adapter, "_donor_match", host_resident)
    target = _semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["declined"].get("donor_on_host") == 1, snap
    assert snap["outcomes"]["materialized"] == 0
    assert len(runtime.provider.index) == 2  # donor kept, target registered
    check_invariants(h, full_kv=True)

    monkeypatch.setattr(adapter, "_donor_match", real)  # back on the device
    doc = _document(passages, 2, 8)
    again = h.submit(instructions[3] + doc, max_new_tokens=2)
    h.run_until_idle()
    assert again.finished()
    assert runtime.provider.snapshot()["outcomes"]["materialized"] == 1
    check_invariants(h, full_kv=True)
    _assert_drained(h)


def test_cache_reset_forgets_every_donor(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    h.submit(instructions[0] + _document(passages, 2, 8))
    h.run_until_idle()
    assert len(adapter.runtime.provider.index) == 1
    # What Scheduler.flush_cache does (the harness is idle: no request holds slots).
    h.cache.reset()
    h.cache.req_to_token_pool.clear()
    h.cache.token_to_kv_pool_allocator.clear()
    assert len(adapter.runtime.provider.index) == 0
    target = h.submit(instructions[5] + _document(passages, 2, 8), max_new_tokens=2)
    h.run_until_idle()
    assert target.finished()
    snap = adapter.runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 0 and "donor_evicted" not in snap["declined"]
    check_invariants(h, full_kv=True)


def test_request_aborted_while_waiting_after_its_lookup_leaves_no_state(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """The scheduler matches waiting requests (admission, priority) before running them; one
    aborted while still waiting never reaches on_release, only UnifiedRadixCache.finish(ABORT)."""
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    runtime = adapter.runtime
    target = _semantic_pair(h, passages, instructions)
    target.init_next_round_input(h.cache)  # the lookup of a waiting request
    assert target.rid in runtime.requests
    h.abort(target)
    assert target.rid not in runtime.requests and target.rid not in runtime.settled
    snap = runtime.provider.snapshot()
    assert snap["declined"] == {"no_donor": 1, "aborted": 1}, snap  # the donor, the target
    assert snap["outcomes"]["materialized"] == 0
    h.run_until_idle()
    check_invariants(h, full_kv=True)
    _assert_drained(h)


def test_hook_time_is_counted_on_every_request_path_hook(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    runtime = adapter.runtime
    calls: dict[str, int] = {}
    real = runtime.guarded

    def counting(where: str, *args: Any) -> Any:
        calls[where] = calls.get(where, 0) + 1
        return real(where, *args)

    runtime.guarded = counting  # type: ignore[method-assign]
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)  # resets the cache
    target = _semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 1, snap
    assert snap["hook_calls"] == sum(calls.values()) > 0
    assert {"reset", "match_prefix", "checkpoint", "release", "admission"} <= set(calls), calls
    assert 0 < snap["hook_seconds"] < 60
    assert snap["hook_seconds"] * 1000 >= snap["lookup_ms_mean"] * snap["lookups"]


# ---- install / uninstall -------------------------------------------------------------------


def test_patch_is_idempotent_and_unpatch_restores_the_originals() -> None:
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    unpatch_radix_cache()
    names = [
        (UnifiedRadixCache, "match_prefix"),
        (UnifiedRadixCache, "checkpoint"),
        (UnifiedRadixCache, "on_release"),
        (UnifiedRadixCache, "reset"),
        (PrefillAdder, "_select_prefill_admission"),
        (PrefillAdder, "add_chunked_req"),
    ]
    inherited_finish = UnifiedRadixCache.finish  # BasePrefixCache's: wrapped, then deleted
    assert "finish" not in UnifiedRadixCache.__dict__
    originals = {key: key[0].__dict__[key[1]] for key in names}
    first = patch_radix_cache(CONFIG)
    assert patch_radix_cache(CONFIG) is first is installed_adapter()
    for owner, name in names:
        assert owner.__dict__[name] is not originals[(owner, name)]
        assert owner.__dict__[name].__wrapped__ is originals[(owner, name)]
    assert UnifiedRadixCache.__dict__["finish"].__wrapped__ is inherited_finish
    unpatch_radix_cache()
    unpatch_radix_cache()
    assert installed_adapter() is None
    for owner, name in names:
        assert owner.__dict__[name] is originals[(owner, name)]
    assert "finish" not in UnifiedRadixCache.__dict__
    assert UnifiedRadixCache.finish is inherited_finish


def test_plugin_patches_a_process_started_with_spawn(tmp_path: Any) -> None:
    code = (
        "import multiprocessing as mp\n"
        "def child(q):\n"
        "    from semblend_sglang.cpu_runtime import ensure_torchvision_importable\n"
        "    ensure_torchvision_importable()\n"
        "    from sglang.srt.plugins import load_plugins\n"
        "    load_plugins()\n"
        "    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as U\n"
        "    q.put(hasattr(U.__dict__['match_prefix'], '__wrapped__'))\n"
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


# ---- substitute mode ---------------------------------------------------------------------------


def test_substituted_prompt_puts_the_donor_head_before_the_shared_span() -> None:
    from array import array

    from semblend_sglang.align import Span
    from semblend_sglang.namespace import Namespace
    from semblend_sglang.patches.sglang.substitute import substituted_prompt
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
        sink_tokens=1,
        substitute=True,
    )
    out = substituted_prompt(target, donor, plan)
    assert out is not None and out.typecode == "q"
    assert list(out) == [7, 7, 7, 1, 2, 3, 4, 5, 6, 0, 0, 0]  # donor[:9] + target[8:]
    assert substituted_prompt(target, donor[:6], plan) is None  # donor shorter than its span
    changed = list(donor)
    changed[5] = 99
    assert substituted_prompt(target, changed, plan) is None  # donor no longer matches
