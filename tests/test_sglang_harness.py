"""The cache-level harness on vanilla sglang 0.5.23, and its checker against the known hazard.

Vanilla sglang must keep every invariant over a randomized run of real essay traffic; a
deliberately wrong integration (a donor's match returned for a request whose tokens differ,
docs/architecture.md, "The hazard") must make `check_invariants` fail.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_harness import (
    HarnessConfig,
    InvariantViolation,
    SglangCacheHarness,
    check_invariants,
)

INSTRUCTIONS = [
    "Summarize the essay above in three sentences.",
    "List the main arguments the author makes.",
    "What would a skeptic say about this text?",
    "Rewrite the first paragraph for a ten-year-old.",
    "Which claim in the passage is the weakest, and why?",
    "Give the essay a new title.",
]
NAMESPACES: list[tuple[str | None, str | None]] = [
    (None, None),
    ("adapter-b", None),
    (None, "tenant-c"),
]


@pytest.fixture(scope="module")
def model_config(smollm2_model_dir: Path) -> Any:
    """sglang's ModelConfig of the prepared SmolLM2 folder (3 KV heads, head dim 64)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(model_path=str(smollm2_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def passages(smollm2_tokenizer: Any, essay_texts: list[str]) -> list[list[list[int]]]:
    """Per essay (first 12), consecutive passages of its SmolLM2 tokens, 50-130 tokens each.

    The essays carry no paragraph breaks, so passages are fixed token windows.
    """
    widths = [50, 90, 130, 70, 110]
    out: list[list[list[int]]] = []
    for text in essay_texts[:12]:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        paras, pos, i = [], 0, 0
        while pos + widths[i % len(widths)] <= len(ids) and len(paras) < 12:
            paras.append(ids[pos : pos + widths[i % len(widths)]])
            pos += widths[i % len(widths)]
            i += 1
        if len(paras) >= 4:
            out.append(paras)
    assert len(out) >= 8
    return out


@pytest.fixture(scope="module")
def instructions(smollm2_tokenizer: Any) -> list[list[int]]:
    """The instruction sentences as SmolLM2 token ids."""
    return [smollm2_tokenizer.encode(t, add_special_tokens=False) for t in INSTRUCTIONS]


def _make_prompt(
    rng: random.Random,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    history: list[list[int]],
) -> tuple[str, list[int]]:
    """One prompt: shared document + instruction, shifted, reordered, or an exact repeat."""
    kind = rng.choices(["doc_first", "shifted", "reordered", "repeat"], [4, 2, 2, 2])[0]
    if kind == "repeat" and history:
        return kind, list(rng.choice(history[-40:]))
    essay = rng.choice(passages[:8])
    start = rng.randrange(0, len(essay) - 2)
    parts = essay[start : start + rng.randint(2, 4)]
    instr = rng.choice(instructions)
    if kind == "reordered":
        parts = list(parts)
        rng.shuffle(parts)
    doc = [t for p in parts for t in p]
    if kind == "shifted":
        return kind, instr + doc
    return ("doc_first" if kind != "repeat" else "repeat"), doc + instr


def _drive_random(
    harness: SglangCacheHarness,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    num_requests: int,
    seed: int,
    *,
    retract: bool = False,
) -> dict[str, int]:
    """Submit, step and abort at random (and, with ``retract``, retract running requests as
    sglang's TEST_RETRACT does); check invariants after every step, abort and retraction."""
    rng = random.Random(seed)
    history: list[list[int]] = []
    counts = {"aborted": 0, "chunked": 0, "steps": 0, "decode_steps": 0, "retracted": 0}
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
        elif retract and roll < 0.15 and len(harness.running_batch.reqs) > 1:
            counts["retracted"] += len(harness.retract_decode())
        check_invariants(harness)
    counts["steps"] += harness.run_until_idle()
    check_invariants(harness, full_kv=True)
    counts["chunked"] = len(seen_chunked)
    assert all(r.finished() for r in submitted)
    return counts


def _assert_drained(harness: SglangCacheHarness) -> None:
    """Idle: nothing locked, every page free or evictable tree content."""
    cache = harness.cache
    assert cache.protected_size() == 0
    assert harness.req_to_token_pool.available_size() == harness.config.max_running_requests
    pool = harness.config.pool_tokens
    assert harness.allocator.available_size() + cache.evictable_size() == pool


@pytest.mark.parametrize(
    ("backend", "page_size", "num_requests", "min_hits"),
    [("rust", 1, 520, 90), ("python", 16, 120, 8)],
)
def test_vanilla_sglang_keeps_invariants(
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    backend: str,
    page_size: int,
    num_requests: int,
    min_hits: int,
) -> None:
    harness = SglangCacheHarness(
        HarnessConfig(
            tree_core_backend=backend,
            page_size=page_size,
            pool_tokens=6144,
            chunked_prefill_size=256,
            max_running_requests=8,
        ),
        model_config,
    )
    expected_core = "RustUnifiedTreeCore" if backend == "rust" else "UnifiedTreeCore"
    assert type(harness.cache.tree_core).__name__ == expected_core
    counts = _drive_random(harness, passages, instructions, num_requests, seed=20261122)
    stats = harness.stats
    print(f"harness {backend}/page {page_size}: {stats} {counts} checks={harness.checks_run}")
    assert stats["requests"] == num_requests
    # Exact prefix hits happen, in several namespaces, and are checked (check_exact_match).
    assert stats["prefix_hits"] >= min_hits, stats
    assert stats["hit_tokens"] >= 50 * stats["prefix_hits"], stats
    assert stats["evicted_steps"] >= 10, stats
    assert counts["chunked"] >= 5, counts
    assert counts["aborted"] >= 3, counts
    assert counts["decode_steps"] >= 10, counts
    _assert_drained(harness)


def test_namespaces_do_not_share_prefixes(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    harness = SglangCacheHarness(HarnessConfig(pool_tokens=2048), model_config)
    doc = [t for p in passages[0][:3] for t in p] + instructions[0]
    harness.submit(doc)
    harness.run_until_idle()
    hits: dict[tuple[str | None, str | None], int] = {}
    for extra_key, cache_salt in [*NAMESPACES[1:], NAMESPACES[0]]:
        req = harness.submit(doc, extra_key=extra_key, cache_salt=cache_salt)
        harness.step()
        check_invariants(harness)
        hits[(extra_key, cache_salt)] = req.prefix_len
        harness.run_until_idle()
    assert hits[("adapter-b", None)] == 0
    assert hits[(None, "tenant-c")] == 0
    assert hits[(None, None)] == len(doc) - 1
    check_invariants(harness, full_kv=True)


# ---- the hazard: a deliberately wrong integration -----------------------------------------------


class HazardDonorMatch:
    """THE HAZARD (docs/architecture.md), built on purpose to prove the checker sees it.

    Wraps `UnifiedRadixCache.match_prefix` and, when the exact match is shorter than the donor
    path, returns the donor's node and length for a request whose own tokens differ. sglang then
    puts the donor's slots in the request's row and `checkpoint()` inserts the request's tokens
    with them. Never do this in real code.
    """

    def __init__(self, harness: SglangCacheHarness, donor_node: Any, donor_len: int) -> None:
        self.cache = harness.cache
        self.original = harness.cache.match_prefix
        self.donor_node = donor_node
        self.donor_len = donor_len
        harness.cache.match_prefix = self  # type: ignore[method-assign]

    def __call__(self, params: Any) -> Any:
        result = self.original(params)
        if params.req is None or result.device_prefix_len >= self.donor_len:
            return result
        length = min(self.donor_len, len(params.key) - 1)
        node = self.donor_node
        return result._replace(
            device_prefix_len=length,
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
) -> tuple[SglangCacheHarness, Any]:
    harness = SglangCacheHarness(HarnessConfig(pool_tokens=2048), model_config)
    req = harness.submit(donor, extra_key=extra_key)
    harness.run_until_idle()
    assert req.finished()
    return harness, req.last_node


def test_checker_catches_donor_kv_reached_by_exact_match(
    model_config: Any, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    donor, recipient = _donor_and_recipient(passages, instructions)
    harness, donor_node = _harness_with_donor(model_config, donor)
    HazardDonorMatch(harness, donor_node, len(donor) - 1)
    req = harness.submit(recipient)
    harness.step()
    assert req.prefix_len >= len(donor) - 2  # sglang took the donor's prefix
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
    harness.step()  # prefill + release: checkpoint() inserts the recipient with donor slots
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
    req = harness.submit(recipient)
    harness.run_until_idle()
    check_invariants(harness, full_kv=True)
    # Copy the donor's KV of the shared document over the recipient's own slots, position for
    # position and without any other change: what a reuse path that published its result
    # into the tree would leave behind.
    shift = len(instructions[1])
    recipient_slots = harness.cache.path_device_indices(req.last_node)
    donor_req = harness.submit(donor)
    harness.step()
    donor_slots = harness.cache.prefix_device_indices(donor_req)
    harness.run_until_idle()
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
    assert req.prefix_len >= len(donor) - 2
    with pytest.raises(InvariantViolation, match="exact match of"):
        check_invariants(harness)
