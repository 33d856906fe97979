"""Donors are forgotten when SGLang evicts their KV, at the eviction
(patches/sglang/flow/donor_heads.py), not at the next lookup that finds them gone. Real sglang
0.5.23 cache classes on CPU (tests/harness) with semblend patched; a pool small enough that
every new document evicts older ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from semblend_sglang.config import Config
from semblend_sglang.patches.sglang.flow.donor_kv import held_of
from tests.harness import (
    HarnessConfig,
    SglangCacheHarness,
    chain_hashes,
    check_invariants,
    namespace_seed,
)
from tests.harness.reuse import installed

CONFIG = Config(min_prompt_tokens=64, min_reuse_tokens=32, min_reuse_ratio=0.2)


@pytest.fixture
def adapter() -> Iterator[Any]:
    yield from installed(CONFIG)


def _dead_donors(h: SglangCacheHarness, adapter: Any) -> list[Any]:
    """Registered donors (not held) whose first ``min_span_tokens`` no tree slot holds, read
    without touching the tree (a match would split nodes and refresh their LRU order): the
    harness stores each position's chain hash in its KV, so the donor's prefix is in the tree
    when a tree slot at its last position holds its chain hash."""
    runtime = adapter.runtime
    store = held_of(h.cache)
    walk = h.cache.tree_core.walk_for_kv_canary(False, False)
    at = CONFIG.min_span_tokens - 1
    held_hashes = {
        h._stored_hash(int(slot))
        for slot, pos in zip(walk.slot_indices, walk.positions, strict=True)
        if int(pos) == at
    }
    dead = []
    for handle in runtime.provider.index.handles():
        if store is not None and handle in store:
            continue
        head = adapter.flow.donors.tokens(handle)[: at + 1].tolist()
        if chain_hashes(namespace_seed(1), head)[-1] not in held_hashes:
            dead.append(handle)
    return dead


def test_a_donor_whose_kv_is_evicted_is_forgotten_at_the_eviction(
    adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
) -> None:
    h = SglangCacheHarness(HarnessConfig(pool_tokens=1600), model_config)
    runtime = adapter.runtime
    docs = [[t for p in passages[e][:8] for t in p] for e in range(6)]
    for i, doc in enumerate(docs):
        req = h.submit(instructions[i] + doc, max_new_tokens=2)
        while not req.finished():
            h.step()
            check_invariants(h)
            assert _dead_donors(h, adapter) == []  # right after every step, not lazily
    assert adapter.flow.donors.evicted >= 2, runtime.snapshot()
    assert runtime.snapshot()["evicted_donors"] == adapter.flow.donors.evicted
    assert len(runtime.provider.index.handles()) < len(docs)
    # the newest document is still a donor, and a changed instruction reuses it
    target = h.submit(instructions[0] + docs[-1], max_new_tokens=2)
    h.run_until_idle()
    assert target.finished()
    snap = runtime.snapshot()
    assert snap["outcomes"]["materialized"] == 1, snap
    assert "donor_evicted" not in snap["declined"], snap
    check_invariants(h, full_kv=True)


def test_every_donor_sharing_a_freed_head_is_reported_once() -> None:
    import torch

    from semblend_sglang.patches.sglang.flow.donor_heads import DonorHeads

    heads = DonorHeads(bound=10, is_donor=lambda _h: True)
    for handle, slot in (("a", 5), ("b", 5), ("c", 7)):
        heads.watch(handle, slot)
    heads.freed(torch.tensor([1, 5, 9]))
    assert sorted(heads.take_freed()) == ["a", "b"]
    assert heads.take_freed() == []
    assert "c" in heads and "a" not in heads and len(heads) == 1
    heads.freed(torch.tensor([5]))  # no longer watched: nothing reported twice
    assert heads.take_freed() == []


def test_the_watch_never_outgrows_the_index() -> None:
    from semblend_sglang.patches.sglang.flow.donor_heads import DonorHeads

    registered = {"x", "y"}
    heads = DonorHeads(bound=2, is_donor=lambda h: h in registered)
    heads.watch("old", 1)  # dropped from the index later (its LRU bound)
    heads.watch("x", 2)
    heads.watch("y", 3)
    assert "old" not in heads and len(heads) == 2
