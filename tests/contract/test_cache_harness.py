"""The cache-level harness on vanilla sglang, and its checker against the known hazard, on
whichever sglang is installed (0.5.23's `UnifiedRadixCache` in `make test`, 0.5.15's `RadixCache`
in `make test-legacy`; tests/harness/versions.py).

Vanilla sglang must keep every invariant over a randomized run of real essay traffic (eviction,
chunked prefill, aborts, three namespaces); a deliberately wrong integration (a donor's match
returned for a request whose tokens differ, docs/architecture.md, "The hazard") must make
`check_invariants` fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness.driver import CacheHarness, HarnessConfig
from tests.harness.invariants import InvariantViolation, assert_drained, check_invariants
from tests.harness.traffic import NAMESPACES, drive_random
from tests.harness.versions import VanillaCase, contract_part

PART = contract_part()


@pytest.mark.parametrize("case", PART.vanilla_cases, ids=lambda c: f"{c.backend}-page{c.page_size}")
def test_vanilla_sglang_keeps_invariants(
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    case: VanillaCase,
) -> None:
    harness = PART.harness_cls(
        HarnessConfig(
            tree_core_backend=case.backend,
            page_size=case.page_size,
            pool_tokens=6144,
            chunked_prefill_size=256,
            max_running_requests=8,
        ),
        model_config,
    )
    PART.check_tree(harness, case.backend)
    counts = drive_random(harness, passages, instructions, case.num_requests, seed=20261122)
    stats = harness.stats
    print(f"{PART.name} harness {case}: {stats} {counts} checks={harness.checks_run}")
    assert stats["requests"] == case.num_requests
    # Exact prefix hits happen, in several namespaces, and are checked (check_exact_match).
    assert stats["prefix_hits"] >= case.min_hits, stats
    assert stats["hit_tokens"] >= 50 * stats["prefix_hits"], stats
    assert stats["evicted_steps"] >= 10, stats
    assert counts["chunked"] >= 5, counts
    assert counts["aborted"] >= 3, counts
    assert counts["decode_steps"] >= case.min_decode_steps, counts
    assert_drained(harness)


def test_namespaces_do_not_share_prefixes(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    harness = PART.harness_cls(HarnessConfig(pool_tokens=2048), model_config)
    doc = [t for p in passages[0][:3] for t in p] + instructions[0]
    harness.submit(doc)
    harness.run_until_idle()
    hits: dict[tuple[str | None, str | None], int] = {}
    for extra_key, cache_salt in [*NAMESPACES[1:], NAMESPACES[0]]:
        req = harness.submit(doc, extra_key=extra_key, cache_salt=cache_salt)
        harness.step()
        check_invariants(harness)
        hits[(extra_key, cache_salt)] = PART.exact_hit(req)
        harness.run_until_idle()
    assert hits[("adapter-b", None)] == 0
    assert hits[(None, "tenant-c")] == 0
    assert hits[(None, None)] == len(doc) - 1
    check_invariants(harness, full_kv=True)


# ---- the hazard: a deliberately wrong integration (tests/harness/hazard.py) --------------------


def _donor_and_recipient(
    passages: list[list[list[int]]], instructions: list[list[int]]
) -> tuple[list[int], list[int]]:
    doc = [t for p in passages[1][:3] for t in p]
    return doc + instructions[0], instructions[1] + doc + instructions[0]


def _harness_with_donor(
    model_config: Any, donor: list[int], *, extra_key: str | None = None
) -> tuple[CacheHarness, Any]:
    """A harness whose tree holds `donor` (all of it), and the donor's last tree node."""
    harness = PART.harness_cls(HarnessConfig(pool_tokens=2048), model_config)
    req = harness.submit(donor, extra_key=extra_key)
    harness.run_until_idle()
    assert req.finished()
    slots, node = harness.tree_match(donor, extra_key)
    assert slots.numel() == len(donor)
    return harness, node


def test_checker_catches_donor_kv_reached_by_exact_match(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    donor, recipient = _donor_and_recipient(passages, instructions)
    harness, donor_node = _harness_with_donor(model_config, donor)
    PART.hazard_cls(harness, donor_node, len(donor) - 1)
    req = harness.submit(recipient)
    harness.step()
    assert PART.exact_hit(req) >= len(donor) - 2  # sglang took the donor's prefix
    with pytest.raises(InvariantViolation, match="exact match of"):
        check_invariants(harness)


def test_checker_catches_double_ownership_and_double_free(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    donor, recipient = _donor_and_recipient(passages, instructions)
    harness, donor_node = _harness_with_donor(model_config, donor)
    hazard = PART.hazard_cls(harness, donor_node, len(donor) - 1)
    harness.submit(recipient)
    harness.step()  # prefill + release: publishing inserts the recipient with donor slots
    harness.pending_violations.clear()  # leave only the tree state to the checker
    hazard.remove()
    with pytest.raises(InvariantViolation, match="owned by two tree nodes"):
        check_invariants(harness)
    # Eviction frees the shared slots twice: the free list gets duplicates / outgrows the pool.
    harness.cache.evict(EvictParams(num_tokens=harness.config.pool_tokens))
    with pytest.raises(InvariantViolation, match="free list"):
        check_invariants(harness)


def test_checker_catches_approximate_kv_in_the_tree(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    donor, recipient = _donor_and_recipient(passages, instructions)
    harness, _ = _harness_with_donor(model_config, donor)
    harness.submit(recipient)
    harness.run_until_idle()
    check_invariants(harness, full_kv=True)
    # Copy the donor's KV of the shared document over the recipient's own slots, position for
    # position and without any other change: what a reuse path that published its result
    # into the tree would leave behind.
    shift = len(instructions[1])
    recipient_slots, _ = harness.tree_match(recipient)
    donor_slots, _ = harness.tree_match(donor)
    n = len(donor) - len(instructions[0])
    dst = recipient_slots[shift : shift + n].to(torch.int64)
    src = donor_slots[:n].to(torch.int64)
    for layer in range(harness.config.num_layers):
        harness.kv_pool.k_buffer[layer][dst] = harness.kv_pool.k_buffer[layer][src]
        harness.kv_pool.v_buffer[layer][dst] = harness.kv_pool.v_buffer[layer][src]
    harness.mark_dirty(dst)
    with pytest.raises(InvariantViolation, match="tree KV"):
        check_invariants(harness)


def test_checker_catches_a_namespace_crossing(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    donor, _ = _donor_and_recipient(passages, instructions)
    harness, donor_node = _harness_with_donor(model_config, donor, extra_key="adapter-b")
    PART.hazard_cls(harness, donor_node, len(donor) - 1)
    req = harness.submit(donor)  # the same tokens, in the default namespace
    harness.step()
    assert PART.exact_hit(req) >= len(donor) - 2
    with pytest.raises(InvariantViolation, match="exact match of"):
        check_invariants(harness)
