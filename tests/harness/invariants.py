"""The safety checker of a cache harness: what must hold after every scheduler step.

`check_invariants` reads the pool, the allocator, the tree and every live request's row through
the harness's version-neutral views (`free_pages`, `tree_slots`, `tree_walk`, `kv_bounds`,
`matched_slots`, ...) and raises `InvariantViolation` when a rule is broken. It only reads: it
never matches, locks, evicts or touches LRU state. `assert_drained` is the idle state a test
ends in.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from tests.harness.kv_model import (
    HASH_MODULUS,
    HASH_MULTIPLIER,
    NAMESPACE_SEED_MULTIPLIER,
    chain_hashes,
    cold_kv,
    namespace_seed,
)

if TYPE_CHECKING:
    from tests.harness.driver import CacheHarness


class InvariantViolation(AssertionError):
    """Raised by `check_invariants` when the cache state breaks a safety rule."""


@dataclasses.dataclass(frozen=True)
class TreeWalk:
    """Every device slot of the tree: its position on its path and the previous slot on that
    path (-1 at the root); with the token id and namespace id of each slot when the version
    reads them from the node keys (None when the keys are not readable, e.g. a Rust core)."""

    slots: list[int]
    positions: list[int]
    prevs: list[int]
    tokens: list[int] | None = None
    namespaces: list[int] | None = None


def check_invariants(h: CacheHarness, *, full_kv: bool = False) -> None:
    """Raise `InvariantViolation` if the cache state breaks any safety rule.

    Callers: tests, after every harness step. Reads only: it never matches, locks, evicts or
    touches LRU state. Checks:
    1. free + tree-owned + request-owned + held-donor pages == pool pages, pairwise disjoint,
       and, with no live request, available + evictable == pool (SGLang's idle check);
    2. no duplicate in the allocator free list;
    3. no slot owned by two tree nodes;
    4. no slot both free and owned;
    5. every tree slot holds the KV a cold prefill of its token path produces (`_check_tree_kv`:
       chain induction over the tree walk, then all K/V values for slots that are new in the
       tree, moved, or written since their last full comparison (`mark_dirty`), and for every
       slot when `full_kv` or on every 20th check);
    6. no namespace crossed: a tree path keeps one namespace, and every exact match made since
       the last check (verified by `check_exact_match` when sglang made it) returned slots
       holding cold KV of the request's own tokens in the request's own namespace.
    """
    _raise_pending(h)  # matches happened first: report them first
    ps = h.config.page_size
    num_pages = h.config.pool_tokens // ps
    free_list = h.free_pages().tolist()
    free_set = set(free_list)
    if len(free_set) != len(free_list):
        raise InvariantViolation(
            f"free list holds duplicates: {len(free_list)} entries, {len(free_set)} distinct"
        )
    if len(free_list) > num_pages:
        raise InvariantViolation(f"free list ({len(free_list)}) exceeds pool ({num_pages})")

    walk = h.tree_walk()
    tree_values = h.tree_slots()
    tree_slot_set = set(tree_values)
    if len(tree_slot_set) != len(tree_values):
        dup = len(tree_values) - len(tree_slot_set)
        raise InvariantViolation(f"{dup} slots owned by two tree nodes")
    tree_pages = {s // ps for s in tree_values}

    live = h.live_requests()
    req_pages = _request_pages(h, live, tree_slot_set, tree_pages)
    held_list = _held_slots(h)
    if len(set(held_list)) != len(held_list):
        raise InvariantViolation("a slot is held twice by the held-donor store")
    held_pages = {s // ps for s in held_list}
    if len(held_pages) * ps != len(held_list):
        raise InvariantViolation("the held-donor store holds part of a page")
    for name, owned_set in (("tree", tree_pages), ("request", req_pages)):
        both = owned_set & held_pages
        if both:
            raise InvariantViolation(f"{len(both)} {name}-owned pages are also held donors")
    for name, owned_set in (("tree", tree_pages), ("request", req_pages), ("held", held_pages)):
        both = owned_set & free_set
        if both:
            raise InvariantViolation(f"{len(both)} {name}-owned pages are also free")
    total = len(free_set) + len(tree_pages) + len(req_pages) + len(held_pages)
    owned_all = free_set | tree_pages | req_pages | held_pages
    if total != num_pages or owned_all != set(range(1, num_pages + 1)):
        raise InvariantViolation(
            f"free {len(free_set)} + tree {len(tree_pages)} + requests {len(req_pages)} "
            f"+ held {len(held_pages)} = {total} != pool {num_pages} pages"
        )
    if not live:  # SGLang's idle check: available + evictable == pool
        accounted = int(h.allocator.available_size()) + int(h.cache.evictable_size())
        if accounted != h.config.pool_tokens:
            raise InvariantViolation(
                f"idle: available + evictable = {accounted} != pool {h.config.pool_tokens}"
            )

    h.checks_run += 1
    _check_tree_kv(h, walk, tree_slot_set, full_kv or h.checks_run % 20 == 0)


def _request_pages(
    h: CacheHarness, live: list[Any], tree_slot_set: set[int], tree_pages: set[int]
) -> set[int]:
    """Pages the live requests own (after their protected tree prefix); raises when a
    protected prefix is not the tree's or a page is owned twice."""
    ps = h.config.page_size
    req_pages: set[int] = set()
    for req in live:
        row = h.row(req)
        lo, hi = h.kv_bounds(req)
        tree_part = row[:lo].to(torch.int64).tolist()
        if any(s not in tree_slot_set for s in tree_part):
            raise InvariantViolation(f"{req.rid}: protected prefix slots not owned by the tree")
        owned = {int(s) // ps for s in row[lo:hi].tolist()}
        if owned & req_pages:
            raise InvariantViolation(f"{req.rid}: slots shared with another live request")
        if owned & tree_pages:
            raise InvariantViolation(f"{req.rid}: request-owned slots also owned by the tree")
        req_pages |= owned
    return req_pages


def _held_slots(h: CacheHarness) -> list[int]:
    """Slots the adapter's held-donor store owns on this cache (empty without one)."""
    from semblend_sglang.patches.sglang.flow.donor_kv import held_of

    store = held_of(h.cache)
    return [] if store is None else store.all_slots().tolist()


def _check_tree_kv(h: CacheHarness, walk: TreeWalk, tree_slot_set: set[int], full_kv: bool) -> None:
    """Chain check of every tree slot, vectorized, by induction over the parent links.

    For each slot the stored (position, hash, namespace) must equal (its walk position,
    H(parent's stored hash or the namespace seed, its token), its parent's namespace). Since
    roots start from the seed, this proves every stored hash equals the cold chain hash of the
    slot's token path. Tokens and namespaces come from the node keys where the walk read them
    and from the stored fields otherwise (a Rust core's keys are not readable without the
    test-only inspection build). Full K/V of all layers and heads is then compared with
    `cold_kv` for new, moved or dirty slots, or for all of them when `full_kv`.
    """
    if set(walk.slots) != tree_slot_set or len(walk.slots) != len(tree_slot_set):
        raise InvariantViolation("tree walk and the tree's values disagree on tree slots")
    if not walk.slots:
        return
    slots = torch.tensor(walk.slots, dtype=torch.int64)
    positions = torch.tensor(walk.positions, dtype=torch.int64)
    prevs = torch.tensor(walk.prevs, dtype=torch.int64)
    stored = h.kv_pool.k_buffer[0][slots, 0, :4].to(torch.int64)
    tok, spos, shash, sns = stored.unbind(1)
    if walk.tokens is not None and walk.namespaces is not None:
        key_tok = torch.tensor(walk.tokens, dtype=torch.int64)
        key_ns = torch.tensor(walk.namespaces, dtype=torch.int64)
        _fail_where(h, tok != key_tok, slots, positions, "holds KV of another token than its node")
        _fail_where(h, sns != key_ns, slots, positions, "holds KV of another namespace")
        tok, sns = key_tok, key_ns
    _fail_where(h, spos != positions, slots, positions, "holds KV of another position")
    row_of = torch.full((h.dirty.numel(),), -1, dtype=torch.int64)
    row_of[slots] = torch.arange(slots.numel())
    has_parent = prevs >= 0
    parent_row = torch.where(has_parent, row_of[prevs.clamp(min=0)], 0)
    _fail_where(h, has_parent & (parent_row < 0), slots, positions, "parent slot not in tree")
    _fail_where(h, ~has_parent & (positions != 0), slots, positions, "root child not at 0")
    seed = (sns * NAMESPACE_SEED_MULTIPLIER + 1) % HASH_MODULUS
    prev_hash = torch.where(has_parent, shash[parent_row], seed)
    prev_ns = torch.where(has_parent, sns[parent_row], sns)
    want_hash = (prev_hash * HASH_MULTIPLIER + tok + 1) % HASH_MODULUS
    _fail_where(h, prev_ns != sns, slots, positions, "namespace differs from its parent's")
    _fail_where(h, want_hash != shash, slots, positions, "holds approximate KV (context)")
    fields = torch.stack([positions, shash, tok, sns], dim=1)
    changed = (h.verified_fields[slots] != fields).any(1) | h.dirty[slots]
    sel = torch.arange(slots.numel()) if full_kv else changed.nonzero().flatten()
    if sel.numel():
        _expect_cold(
            h,
            slots[sel].tolist(),
            tok[sel].tolist(),
            positions[sel].tolist(),
            shash[sel].tolist(),
            sns[sel].tolist(),
            "tree KV",
        )
        h.verified_fields[slots[sel]] = fields[sel]
        h.dirty[slots[sel]] = False


def _fail_where(
    h: CacheHarness,
    bad: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    what: str,
) -> None:
    if bool(bad.any()):
        j = int(bad.nonzero()[0])
        got = h.kv_pool.k_buffer[0][int(slots[j]), 0, :4].tolist()
        raise InvariantViolation(
            f"tree KV: slot {int(slots[j])} at position {int(positions[j])} {what} "
            f"(stored [token, pos, hash, ns]={got}; {int(bad.sum())} slots)"
        )


def _expect_cold(
    h: CacheHarness,
    slots: list[int],
    tokens: list[int],
    positions: list[int],
    hashes: list[int],
    ns: list[int],
    what: str,
) -> None:
    if not slots:
        return
    idx = torch.tensor(slots, dtype=torch.int64)
    t = torch.tensor(tokens, dtype=torch.int64)
    p = torch.tensor(positions, dtype=torch.int64)
    hh = torch.tensor(hashes, dtype=torch.int64)
    s = torch.tensor(ns, dtype=torch.int64)
    for layer in range(h.config.num_layers):
        k, v = cold_kv(t, p, hh, s, layer, h.head_num, h.head_dim)
        got_k, got_v = h.kv_pool.k_buffer[layer][idx], h.kv_pool.v_buffer[layer][idx]
        if torch.equal(got_k, k) and torch.equal(got_v, v):
            continue
        bad = ~((got_k == k).flatten(1).all(1) & (got_v == v).flatten(1).all(1))
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            got = h.kv_pool.k_buffer[layer][slots[j], 0, :4].tolist()
            raise InvariantViolation(
                f"{what}: slot {slots[j]} (position {positions[j]}, layer {layer}) holds KV "
                f"[token, pos, hash, ns]={got}, cold prefill gives "
                f"{[tokens[j], positions[j], hashes[j], ns[j]]}"
            )


def check_exact_match(h: CacheHarness, req: Any) -> None:
    """Raise `InvariantViolation` unless `req`'s matched prefix holds cold KV of its own tokens.

    Callers: the harness right after `init_next_round_input` matched `req`. Reads only.
    """
    slots = h.matched_slots(req).to(torch.int64)
    n = int(slots.numel())
    if n <= 0:
        return
    tokens = [int(t) for t in req.full_untruncated_fill_ids[:n]]
    ns = h.ns_of(req)
    hashes = chain_hashes(namespace_seed(ns), tokens)
    salt = getattr(req, "cache_salt", None)
    _expect_cold(
        h,
        slots.tolist(),
        tokens,
        list(range(n)),
        hashes,
        [ns] * n,
        f"exact match of {req.rid} (namespace {req.extra_key!r}/{salt!r})",
    )


def assert_drained(h: CacheHarness) -> None:
    """Idle: nothing locked, every page free or evictable tree content."""
    cache = h.cache
    assert cache.protected_size() == 0
    assert h.req_to_token_pool.available_size() == h.config.max_running_requests
    pool = h.config.pool_tokens
    assert h.allocator.available_size() + cache.evictable_size() == pool


def _raise_pending(h: CacheHarness) -> None:
    pending, h.pending_violations = h.pending_violations, []
    if pending:
        raise pending[0]
