"""The adapter contract at cache level, on whichever sglang is installed (0.5.23's
`UnifiedRadixCacheAdapter` in `make test`, 0.5.15's `LegacyRadixCacheAdapter` in
`make test-legacy`; tests/harness/versions.py): the real tree, pools, allocator, `PrefillAdder`
and `ScheduleBatch` on CPU (tests/harness) with semblend's hooks installed.

What every adapter must do: the materialized KV equals the donor's, rotated (torch reference);
every safety invariant holds over a randomized run with semantic reuse, eviction and aborts;
the fault paths (provider, kernel, evicted donor, donor in host memory, abort while waiting)
complete every request and leak nothing; install/uninstall restore sglang; the plugin patches a
spawned process. What only one version does is tested in tests/test_sglang_patch.py and
tests/legacy/test_legacy_patch.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from semblend_sglang.config import Config
from semblend_sglang.patches.sglang import (
    installed_adapter,
    patch_radix_cache,
    unpatch_radix_cache,
)
from semblend_sglang.plan import Reason
from tests.harness.driver import CacheHarness, HarnessConfig
from tests.harness.invariants import assert_drained, check_invariants
from tests.harness.reuse import (
    assert_next_hit_reuses,
    check_loaded_kv,
    installed,
    materialized,
    step_until,
)
from tests.harness.traffic import document, drive_random, semantic_pair
from tests.harness.versions import contract_part

PART = contract_part()
CONFIG = Config(min_prompt_tokens=64, min_reuse_tokens=32, min_reuse_ratio=0.2)


@pytest.fixture
def adapter() -> Iterator[Any]:
    yield from installed(CONFIG, PART.adapter_cls)


def _harness(model_config: Any, pool_tokens: int) -> CacheHarness:
    return PART.harness_cls(HarnessConfig(pool_tokens=pool_tokens), model_config)


def test_materialized_slots_hold_the_donors_kv_rotated_by_the_shift(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = _harness(model_config, 4096)
    doc = document(passages, 0, 8)
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
        return materialized(adapter.flow, target.rid)

    step_until(h, done)
    chunks = -(-len(target_tokens) // 256)
    if PART.computed_admission:  # admission charges the ~30 positions it computes: one pass
        assert steps - 1 == 1
    else:  # one pass per 256-token chunk, as for a cold prompt: no cut at the span, no 2nd phase
        assert steps - 1 == chunks
    state = adapter.flow.requests[target.rid]
    shift = len(instructions[4] + instructions[2]) - len(instructions[0])
    assert {span.delta for span, _ in state.loaded_pieces} == {shift}
    # each chunk computes its last position: one token per chunk is not reused
    assert state.reused_total >= len(doc) - 2 * CONFIG.sink_tokens - chunks
    # the tree owns the exact head only; the rest of the row is the request's
    assert h.kv_bounds(target)[0] <= state.publish_cap
    assert check_loaded_kv(h, adapter.flow, target) == state.reused_total
    h.run_until_idle()
    assert target.finished() and donor.finished()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 1
    assert snap["reused_tokens"] == state.reused_total
    assert snap["reused_donors"] == 1 and snap["reused_spans"] == state.spans_loaded
    # reuse at any offset is not client-visible: SGLang's count covers the exact prefix only
    assert target.cached_tokens < len(instructions[4])
    check_invariants(h, full_kv=True)
    assert_drained(h)


def test_exact_repeat_after_a_semantic_hit_is_not_served_from_reused_kv(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = _harness(model_config, 4096)
    doc = document(passages, 1, 8)
    h.submit(instructions[1] + doc)
    h.run_until_idle()
    target_tokens = instructions[3] + doc
    first = h.submit(target_tokens)
    h.run_until_idle()
    assert adapter.runtime.provider.snapshot()["outcomes"]["materialized"] == 1
    repeat = h.submit(target_tokens)
    h.step()
    # the exact hit stops where the semantic hit's own head ended: nothing after it was published
    assert 0 < PART.exact_hit(repeat) < len(instructions[3]) + 2 * CONFIG.sink_tokens
    h.run_until_idle()
    check_invariants(h, full_kv=True)  # check_exact_match ran on the repeat's match
    assert first.finished() and repeat.finished()
    assert_drained(h)


def test_randomized_semantic_traffic_keeps_every_invariant(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    harness = PART.harness_cls(
        HarnessConfig(pool_tokens=6144, chunked_prefill_size=256, max_running_requests=8),
        model_config,
    )
    counts = drive_random(harness, passages, instructions, 520, seed=7, flow=adapter.flow)
    snap = adapter.runtime.snapshot()
    print(f"{PART.name} semantic run: {harness.stats} {counts} {snap['outcomes']}")
    print(f"declined: {snap['declined']}")
    assert snap["outcomes"]["materialized"] >= 60, snap  # 127 (0.5.23), 129 (0.5.15) measured
    assert snap["reused_spans"] > snap["outcomes"]["materialized"], snap  # several-span plans
    assert snap["multi_donor_requests"] >= 1, snap
    assert Reason.UNREPORTED not in snap["declined"], snap  # every plan's outcome was recorded
    if PART.held_donors:  # kept and evicted under pressure; reuse from them: own tests
        held = snap["held_donors"]
        assert held["kept"] >= 5 and held["evicted"] >= 1, held
    assert snap["outcomes"]["cold_fallback"] == 0, snap
    assert snap["errors"] == {}, snap
    assert counts["aborted"] >= 3 and counts["chunked"] >= 5, counts
    assert counts["aborted_with_plan"] >= 1, counts  # aborts mid-plan, not only of cold requests
    assert harness.stats["evicted_steps"] >= 10, harness.stats
    assert snap["declined"].get(Reason.DONOR_EVICTED, 0) >= 1, snap  # between lookup and copy
    assert not adapter.flow.requests, "request state leaked past release"
    assert_drained(harness)


def test_reordered_passages_reuse_every_span_with_its_own_shift(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    runtime = adapter.runtime
    h = _harness(model_config, 8192)
    first, second = document(passages, 3, 4), [t for p in passages[3][4:8] for t in p]
    h.submit(instructions[0] + first + second)
    h.run_until_idle()
    target_tokens = instructions[1] + second + instructions[3] + first
    target = h.submit(target_tokens, max_new_tokens=2)
    step_until(h, lambda: materialized(adapter.flow, target.rid))
    state = adapter.flow.requests[target.rid]
    assert len(state.spans) == 2
    shifts = {span.delta for span, _ in state.loaded_pieces}
    assert len(shifts) == 2  # the two passages moved by different shifts
    first_piece = min(state.loaded_pieces, key=lambda p: p[0].target_start)[0]
    last_piece = max(state.loaded_pieces, key=lambda p: p[0].target_start)[0]
    assert first_piece.donor_start > last_piece.donor_start  # in the other order than the donor
    assert check_loaded_kv(h, adapter.flow, target) == state.reused_total
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 1
    assert snap["reused_tokens"] == state.reused_total
    chunks = -(-len(target_tokens) // 256)
    assert state.reused_total >= len(first) + len(second) - 4 * CONFIG.sink_tokens - chunks
    check_invariants(h, full_kv=True)
    assert_drained(h)


# ---- faults ----------------------------------------------------------------------------------


def test_request_aborted_while_waiting_after_its_lookup_leaves_no_state(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """The scheduler matches waiting requests (admission, priority) before running them; one
    aborted while still waiting never reaches the release hooks: the abort path (0.5.23's
    UnifiedRadixCache.finish(ABORT), 0.5.15's Scheduler.abort_request hook) drops its plan,
    declined as aborted."""
    h = _harness(model_config, 4096)
    runtime = adapter.runtime
    target = semantic_pair(h, passages, instructions)
    target.init_next_round_input(h.cache)  # the lookup of a waiting request
    assert target.rid in adapter.flow.requests
    h.abort(target)
    assert target.rid not in adapter.flow.requests and target.rid not in adapter.flow.decided
    snap = runtime.provider.snapshot()
    assert snap["declined"] == {"no_donor": 1, "aborted": 1}, snap  # the donor, the target
    assert snap["outcomes"]["materialized"] == 0
    assert snap["hook_calls"] > 0 and snap["hook_seconds"] > 0
    h.run_until_idle()
    check_invariants(h, full_kv=True)
    assert_drained(h)
    assert_next_hit_reuses(h, adapter.flow, passages, instructions)


def test_request_aborted_between_its_chunks_after_a_copy_leaves_no_state(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """A two-span hit whose computed gap (four instructions between the passages) spans several
    16-token prefill chunks is aborted (a client gone) after a chunk copied its first span's
    donor KV: its donors were pinned for that copy only, its plan ends, its slots go back and
    nothing stays locked; the next hit on the same document reuses normally."""
    from semblend_sglang.patches.sglang.flow.request_reuse import ReuseState

    h = PART.harness_cls(HarnessConfig(pool_tokens=4096, chunked_prefill_size=16), model_config)
    doc = document(passages, 2, 8)
    h.submit(instructions[0] + doc)
    h.run_until_idle()
    half = len(document(passages, 2, 4))
    gap = [t for i in (1, 2, 3, 4) for t in instructions[i]]
    target = h.submit(instructions[5] + doc[:half] + gap + doc[half:], max_new_tokens=2)

    def loading_and_chunked() -> bool:
        state = adapter.flow.requests.get(target.rid)
        return state is not None and state.state is ReuseState.LOADING and h.chunked_req is target

    step_until(h, loading_and_chunked)
    h.abort(target)
    h.run_until_idle()
    assert target.finished() and target.rid not in adapter.flow.requests
    snap = adapter.runtime.snapshot()
    assert snap["outcomes"]["cold_fallback"] == 0 and snap["errors"] == {}, snap
    check_invariants(h, full_kv=True)
    assert_drained(h)
    assert_next_hit_reuses(h, adapter.flow, passages, instructions)


def test_provider_error_falls_back_cold(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = _harness(model_config, 4096)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("index corrupted")

    monkeypatch.setattr(adapter.runtime.provider, "_decide", broken)
    target = semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished() and target.cached_tokens == 0
    snap = adapter.runtime.snapshot()
    assert snap["outcomes"]["cold_fallback"] >= 1 and snap["outcomes"]["materialized"] == 0
    check_invariants(h, full_kv=True)
    assert_drained(h)


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
    h = _harness(model_config, 4096)
    target = semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished()
    snap = adapter.runtime.snapshot()
    assert snap["outcomes"]["cold_fallback"] == 1, snap
    assert snap["errors"] == {"load": 1}, snap
    check_invariants(h, full_kv=True)
    assert_drained(h)  # the donors pinned for the failed copy were unlocked
    monkeypatch.undo()
    assert_next_hit_reuses(h, adapter.flow, passages, instructions)


def test_donor_evicted_between_lookup_and_copy_is_declined(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = _harness(model_config, 4096)
    runtime = adapter.runtime
    evicted: list[str] = []

    def evict_after_lookup(harness: CacheHarness, req: Any) -> None:
        # between the request's lookup (its match) and the copy (in prepare_for_extend)
        if req.rid in adapter.flow.requests and not evicted:
            evicted.append(req.rid)
            harness.cache.evict(EvictParams(num_tokens=harness.config.pool_tokens))

    h.match_hook = evict_after_lookup
    target = semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert evicted == [target.rid]
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["declined"].get("donor_evicted") == 1, snap
    assert snap["outcomes"]["materialized"] == 0
    assert len(runtime.provider.index) == 1  # the evicted donor was forgotten; target registered
    check_invariants(h, full_kv=True)
    assert_drained(h)
    assert_next_hit_reuses(h, adapter.flow, passages, instructions)  # from the target, now


def test_passages_from_two_donors_and_one_evicted_before_the_copy(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    """A plan that takes passages from two donors; the first time, one donor's KV is evicted
    between the lookup and the copy: only its spans are computed, the other donor's are reused.
    The next such request reuses from both, in one pass."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = _harness(model_config, 8192)
    runtime = adapter.runtime
    first, second = document(passages, 4, 4), [t for p in passages[4][4:8] for t in p]
    donor_a = instructions[0] + first + instructions[2]
    donor_b = instructions[1] + second + instructions[3]
    for tokens in (donor_a, donor_b):
        h.submit(tokens)
        h.run_until_idle()
    evicted: list[str] = []

    def evict_donor_b(harness: CacheHarness, req: Any) -> None:
        if req.rid in adapter.flow.requests and not evicted:
            evicted.append(req.rid)
            _, keep = harness.tree_match(donor_a)
            with harness.pinned(keep):  # donor A stays resident
                harness.cache.evict(EvictParams(num_tokens=harness.config.pool_tokens))

    h.match_hook = evict_donor_b
    target = h.submit(instructions[5] + second + instructions[4] + first, max_new_tokens=2)
    step_until(h, lambda: materialized(adapter.flow, target.rid))
    state = adapter.flow.requests[target.rid]
    assert evicted == [target.rid]
    assert len(state.plan.donors) == 2  # the plan took a span from each donor
    assert len(state.donors_loaded) == 1  # donor B's spans were computed instead
    assert check_loaded_kv(h, adapter.flow, target) == state.reused_total
    assert state.reused_total >= len(first) - 2 * CONFIG.sink_tokens - 3
    h.run_until_idle()
    assert target.finished()
    check_invariants(h, full_kv=True)

    h.match_hook = None
    # the target computed B's passages itself: it is their donor now (with held donors it holds
    # the prompt KV it did not publish, A's passages included; without, its exact head is in
    # the tree and indexed as a donor, so the next plan copies from A and from it)
    assert adapter.flow.requests.get(target.rid) is None
    again = h.submit(instructions[3] + first + instructions[1] + second, max_new_tokens=2)
    step_until(h, lambda: materialized(adapter.flow, again.rid))
    state = adapter.flow.requests[again.rid]
    if not PART.held_donors:
        assert len(state.donors_loaded) == 2  # one pass copied spans of both donors
    assert state.reused_total >= len(first) + len(second) - 4 * CONFIG.sink_tokens - 6
    assert check_loaded_kv(h, adapter.flow, again) == state.reused_total
    h.run_until_idle()
    snap = runtime.provider.snapshot()
    assert snap["outcomes"]["materialized"] == 2, snap
    if not PART.held_donors:
        assert snap["multi_donor_requests"] == 1, snap
    check_invariants(h, full_kv=True)
    assert_drained(h)


def test_donor_in_host_memory_is_kept_and_used_after_load_back_mock_host_tier(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HiCache's host pool needs CUDA (cudaHostRegister), so this CPU test fakes the host tier:
    the donor match reports part of the donor's span as host-resident (host_hit_length), as
    HiCache's tree does for a path evicted to host memory. The plan is declined as
    donor_on_host, the donor is kept, and once the path is device-resident again (what SGLang's
    own load-back does) the next request materializes from it."""
    h = _harness(model_config, 8192)
    runtime = adapter.runtime
    back_on_device = PART.fake_host_tier(monkeypatch, adapter)
    target = semantic_pair(h, passages, instructions)
    h.run_until_idle()
    assert target.finished()
    snap = runtime.provider.snapshot()
    assert snap["declined"].get("donor_on_host") == 1, snap
    assert snap["outcomes"]["materialized"] == 0
    assert len(runtime.provider.index) == 2  # donor kept, target registered
    check_invariants(h, full_kv=True)

    back_on_device()
    doc = document(passages, 2, 8)
    again = h.submit(instructions[3] + doc, max_new_tokens=2)
    h.run_until_idle()
    assert again.finished()
    assert runtime.provider.snapshot()["outcomes"]["materialized"] == 1
    check_invariants(h, full_kv=True)
    assert_drained(h)


# ---- install / uninstall -------------------------------------------------------------------


def _function(method: Any) -> Any:
    """The function behind a class attribute (a classmethod's or bound method's ``__func__``)."""
    return getattr(method, "__func__", method)


def test_patch_is_idempotent_and_unpatch_restores_the_originals() -> None:
    unpatch_radix_cache()
    names = PART.hooked_methods()
    originals = {key: key[0].__dict__[key[1]] for key in names}
    first = patch_radix_cache(CONFIG)
    assert isinstance(first, PART.adapter_cls)
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


def test_plugin_patches_a_process_started_with_spawn(tmp_path: Any) -> None:
    code = (
        "import multiprocessing as mp\n"
        "def child(q):\n"
        "    from semblend_sglang.cpu_runtime import ensure_torchvision_importable\n"
        "    ensure_torchvision_importable()\n"
        "    from sglang.srt.plugins import load_plugins\n"
        "    load_plugins()\n"
        f"    from {PART.tree_module} import {PART.tree_class} as T\n"
        "    q.put(hasattr(T.__dict__['match_prefix'], '__wrapped__'))\n"
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
