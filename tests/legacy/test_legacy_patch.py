"""What the legacy adapter (sglang 0.5.15 `RadixCache`) does beyond the adapter contract
(tests/contract, which `make test-legacy` runs on this version): real `RadixCache`, pools,
allocator, `PrefillAdder`, `ScheduleBatch` on CPU (tests/harness) with semblend's hooks installed.

The exact head a request that reused KV publishes, whether its first copy falls inside a chunk or
at a chunk start; discovery-only and substitute modes; adapter selection by version. Skipped
unless the installed sglang is a legacy version (`make test-legacy`).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.versions import legacy_skip_reason, use_triton_interpreter

_SKIP = legacy_skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)
use_triton_interpreter()

from semblend_sglang.config import Config  # noqa: E402
from semblend_sglang.patches.sglang import patch_radix_cache, unpatch_radix_cache  # noqa: E402
from semblend_sglang.patches.sglang.engine.legacy import LegacyRadixCacheAdapter  # noqa: E402
from tests.harness import (  # noqa: E402
    HarnessConfig,
    LegacyCacheHarness,
    assert_drained,
    check_invariants,
    document,
    semantic_pair,
)
from tests.harness.reuse import check_loaded_kv, materialized, step_until  # noqa: E402

CONFIG = Config(min_prompt_tokens=64, min_reuse_tokens=32, min_reuse_ratio=0.2)


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
    target_tokens = instructions[2] + document(passages, 5, 6)

    def run(chunk: int) -> tuple[LegacyCacheHarness, Any, Any]:
        unpatch_radix_cache()
        adapter = patch_radix_cache(CONFIG)
        h = LegacyCacheHarness(
            HarnessConfig(pool_tokens=8192, chunked_prefill_size=chunk), model_config
        )
        h.submit(instructions[0] + document(passages, 5, 6))
        h.run_until_idle()
        target = h.submit(target_tokens, max_new_tokens=2)

        step_until(h, lambda: materialized(adapter.flow, target.rid))
        state = adapter.flow.requests[target.rid]
        cap = state.publish_cap
        assert h.kv_bounds(target)[0] == cap  # the tree holds T[0:c), locked at c
        assert h.tree_match(target_tokens)[0].numel() == cap
        assert check_loaded_kv(h, adapter.flow, target) == state.reused_total
        h.run_until_idle()
        check_invariants(h, full_kv=True)
        assert h.tree_match(target_tokens)[0].numel() == cap  # still: nothing after c published
        assert_drained(h)
        return h, target, state

    try:
        _, _, state = run(256)
        cap, exact = state.publish_cap, state.plan.exact_len
        assert exact < cap < exact + 256  # the first copy inside the first chunk
        _, _, state = run(cap - exact)  # the first chunk ends exactly at c
        assert state.publish_cap == cap
    finally:
        unpatch_radix_cache()


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
        target = semantic_pair(h, passages, instructions)
        h.run_until_idle()
        assert target.finished() and target.cached_tokens == 0
        snap = adapter.runtime.provider.snapshot()  # type: ignore[union-attr]
        assert snap["outcomes"]["discovery_only"] == 1, snap
        assert snap["outcomes"]["materialized"] == 0
        check_invariants(h, full_kv=True)
        assert_drained(h)
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
        doc = document(passages, 3, 8)
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
        assert_drained(h)
    finally:
        unpatch_radix_cache()


def test_the_installed_version_selects_the_legacy_adapter_and_only_it() -> None:
    from packaging.version import Version

    from semblend_sglang.patches.sglang import _adapters
    from semblend_sglang.patches.sglang.engine.adapter import installed_sglang_version

    version = installed_sglang_version()
    assert version is not None
    serving = [cls.__name__ for cls in _adapters() if cls.supports(version)]
    assert serving == ["LegacyRadixCacheAdapter"], (version, serving)
    for v, served in [("0.5.14", False), ("0.5.15", True), ("0.5.15.post1", True),
                      ("0.5.18", True), ("0.5.19", False), ("0.5.20", False)]:  # fmt: skip
        assert LegacyRadixCacheAdapter.supports(Version(v)) is served, v
