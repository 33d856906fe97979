"""The legacy harness on vanilla sglang 0.5.15 (`RadixCache`), and its checker against the hazard.

The legacy counterpart of tests/test_sglang_harness.py: vanilla sglang must keep every invariant
over a randomized run of real essay traffic (eviction, chunked prefill, aborts, three namespaces);
a deliberately wrong integration (a donor's match returned for a request whose tokens differ,
docs/architecture.md, "The hazard") must make `check_invariants` fail. Skipped unless the installed
sglang is a legacy version (`make test-legacy`).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from legacy_support import legacy_skip_reason, use_triton_interpreter

_SKIP = legacy_skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)
use_triton_interpreter()

import torch  # noqa: E402
from legacy_harness import (  # noqa: E402
    HarnessConfig,
    InvariantViolation,
    LegacyCacheHarness,
    check_invariants,
)
from test_sglang_harness import (  # noqa: E402  fixtures and prompt maker of the 0.5.23 tests
    NAMESPACES,
    _assert_drained,
    _make_prompt,
    instructions,
    model_config,
    passages,
)

__all__ = ["instructions", "model_config", "passages"]  # re-exported fixtures


def drive_random(
    harness: LegacyCacheHarness,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    num_requests: int,
    seed: int,
) -> dict[str, int]:
    """tests/test_sglang_harness.py `_drive_random` with the legacy checker: submit, step and
    abort at random; check invariants after every step and abort."""
    rng = random.Random(seed)
    history: list[list[int]] = []
    counts = {"aborted": 0, "chunked": 0, "steps": 0, "decode_steps": 0}
    submitted: list[Any] = []
    seen_chunked: set[str] = set()

    def step() -> None:
        report = harness.step()
        check_invariants(harness)
        counts["steps"] += 1
        counts["decode_steps"] += report.kind == "decode"
        if report.chunked is not None:
            seen_chunked.add(report.chunked.rid)

    for _ in range(num_requests):
        _, tokens = _make_prompt(rng, passages, instructions, history)
        history.append(tokens)
        extra_key, cache_salt = rng.choices(NAMESPACES, [6, 2, 2])[0]
        req = harness.submit(
            tokens,
            max_new_tokens=rng.choice([1, 1, 2, 4]),
            extra_key=extra_key,
            cache_salt=cache_salt,
        )
        submitted.append(req)
        for _ in range(rng.choice([0, 1, 1, 2])):
            step()
        roll = rng.random()
        if roll < 0.03 and harness.waiting_queue:
            harness.abort(rng.choice(harness.waiting_queue))
            counts["aborted"] += 1
        elif roll < 0.06 and harness.chunked_req is not None:
            harness.abort(harness.chunked_req)
            counts["aborted"] += 1
        elif roll < 0.09 and not harness.running_batch.is_empty():
            harness.abort(rng.choice(harness.running_batch.reqs))
            counts["aborted"] += 1
        check_invariants(harness)
    counts["steps"] += harness.run_until_idle()
    check_invariants(harness, full_kv=True)
    counts["chunked"] = len(seen_chunked)
    assert all(r.finished() for r in submitted)
    return counts


@pytest.mark.parametrize(
    ("page_size", "num_requests", "min_hits", "min_decode_steps"),
    [(1, 520, 90, 10), (16, 120, 8, 5)],
)
def test_vanilla_legacy_sglang_keeps_invariants(
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    page_size: int,
    num_requests: int,
    min_hits: int,
    min_decode_steps: int,
) -> None:
    from sglang.srt.mem_cache.radix_cache import RadixCache

    harness = LegacyCacheHarness(
        HarnessConfig(
            page_size=page_size,
            pool_tokens=6144,
            chunked_prefill_size=256,
            max_running_requests=8,
        ),
        model_config,
    )
    assert type(harness.cache) is RadixCache
    counts = drive_random(harness, passages, instructions, num_requests, seed=20261122)
    stats = harness.stats
    print(f"legacy harness page {page_size}: {stats} {counts} checks={harness.checks_run}")
    assert stats["requests"] == num_requests
    assert stats["prefix_hits"] >= min_hits, stats
    assert stats["hit_tokens"] >= 50 * stats["prefix_hits"], stats
    assert stats["evicted_steps"] >= 10, stats
    assert counts["chunked"] >= 5, counts
    assert counts["aborted"] >= 3, counts
    assert counts["decode_steps"] >= min_decode_steps, counts  # 47 and 9 measured
    _assert_drained(harness)  # type: ignore[arg-type]


def test_namespaces_do_not_share_prefixes(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    harness = LegacyCacheHarness(HarnessConfig(pool_tokens=2048), model_config)
    doc = [t for p in passages[0][:3] for t in p] + instructions[0]
    harness.submit(doc)
    harness.run_until_idle()
    hits: dict[tuple[str | None, str | None], int] = {}
    for extra_key, cache_salt in [*NAMESPACES[1:], NAMESPACES[0]]:
        req = harness.submit(doc, extra_key=extra_key, cache_salt=cache_salt)
        harness.step()
        check_invariants(harness)
        hits[(extra_key, cache_salt)] = int(req.cached_tokens)
        harness.run_until_idle()
    assert hits[("adapter-b", None)] == 0
    assert hits[(None, "tenant-c")] == 0
    assert hits[(None, None)] == len(doc) - 1
    check_invariants(harness, full_kv=True)


# ---- the hazard: a deliberately wrong integration -----------------------------------------------


class HazardDonorMatch:
    """THE HAZARD (docs/architecture.md) on the legacy tree, built on purpose to prove the
    checker sees it: when the exact match is shorter than the donor path, `match_prefix` returns
    the donor's node and slots for a request whose own tokens differ. sglang then writes the
    donor's slots into the request's row and `cache_unfinished_req` / `cache_finished_req`
    insert the request's tokens with them. Never do this in real code."""

    def __init__(self, harness: LegacyCacheHarness, donor_node: Any, donor_len: int) -> None:
        self.cache = harness.cache
        self.original = harness.cache.match_prefix
        self.donor_node = donor_node
        self.donor_len = donor_len
        path: list[torch.Tensor] = []
        node = donor_node
        while node is not harness.cache.root_node:
            path.insert(0, node.value)
            node = node.parent
        self.donor_slots = torch.cat(path)
        harness.cache.match_prefix = self  # type: ignore[method-assign]

    def __call__(self, params: Any) -> Any:
        result = self.original(params)
        if params.req is None or len(result.device_indices) >= self.donor_len:
            return result
        length = min(self.donor_len, len(params.key) - 1)
        node = self.donor_node
        return result._replace(
            device_indices=self.donor_slots[:length].clone(),
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )

    def remove(self) -> None:
        """Restore the real method."""
        del self.cache.match_prefix


def _donor_and_recipient(
    passages: list[list[list[int]]], instructions: list[list[int]]
) -> tuple[list[int], list[int]]:
    doc = [t for p in passages[1][:3] for t in p]
    return doc + instructions[0], instructions[1] + doc + instructions[0]


def _harness_with_donor(
    model_config: Any, donor: list[int], *, extra_key: str | None = None
) -> tuple[LegacyCacheHarness, Any]:
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    harness = LegacyCacheHarness(HarnessConfig(pool_tokens=2048), model_config)
    req = harness.submit(donor, extra_key=extra_key)
    harness.run_until_idle()
    assert req.finished()
    found = harness.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", donor), extra_key=extra_key))
    )
    assert len(found.device_indices) == len(donor)
    return harness, found.last_device_node


def test_checker_catches_donor_kv_reached_by_exact_match(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    donor, recipient = _donor_and_recipient(passages, instructions)
    harness, donor_node = _harness_with_donor(model_config, donor)
    HazardDonorMatch(harness, donor_node, len(donor) - 1)
    req = harness.submit(recipient)
    harness.step()
    assert req.cached_tokens >= len(donor) - 2  # sglang took the donor's prefix
    with pytest.raises(InvariantViolation, match="exact match of"):
        check_invariants(harness)


def test_checker_catches_double_ownership_and_double_free(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    donor, recipient = _donor_and_recipient(passages, instructions)
    harness, donor_node = _harness_with_donor(model_config, donor)
    hazard = HazardDonorMatch(harness, donor_node, len(donor) - 1)
    harness.submit(recipient)
    harness.step()  # prefill + release: cache_finished_req inserts the recipient with donor slots
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
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    donor, recipient = _donor_and_recipient(passages, instructions)
    harness, _ = _harness_with_donor(model_config, donor)
    harness.submit(recipient)
    harness.run_until_idle()
    check_invariants(harness, full_kv=True)
    # Copy the donor's KV of the shared document over the recipient's own slots, position for
    # position: what a reuse path that published its result into the tree would leave behind.
    shift = len(instructions[1])
    recipient_slots = harness.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", recipient)))
    ).device_indices
    donor_slots = harness.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", donor)))
    ).device_indices
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
    HazardDonorMatch(harness, donor_node, len(donor) - 1)
    req = harness.submit(donor)  # the same tokens, in the default namespace
    harness.step()
    assert req.cached_tokens >= len(donor) - 2
    with pytest.raises(InvariantViolation, match="exact match of"):
        check_invariants(harness)
