"""Checks of what semblend's semantic reuse did in a cache harness, on any sglang version.

`installed` installs the hooks for a test; `check_loaded_kv` compares every piece a request
reused with its donor's KV (K rotated by the piece's shift with the torch reference, V copied);
`materialized` and `step_until` step a harness until a request's reuse happened;
`assert_next_hit_reuses` is what a test checks after a fault: the next request reuses normally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from semblend_sglang.config import Config
from semblend_sglang.kernels import rotate_k
from semblend_sglang.patches.sglang.flow.donor_kv import held_of
from semblend_sglang.patches.sglang.flow.request_reuse import ReuseState
from tests.harness.driver import CacheHarness
from tests.harness.invariants import assert_drained, check_invariants
from tests.harness.traffic import document


def installed(config: Config, adapter_cls: type[Any] | None = None) -> Iterator[Any]:
    """Generator for fixtures: semblend's hooks installed with `config` (any installed adapter
    first removed; `adapter_cls` asserted when given), yielded, then removed."""
    from semblend_sglang.patches.sglang import patch_radix_cache, unpatch_radix_cache

    unpatch_radix_cache()
    adapter = patch_radix_cache(config)
    assert adapter is not None
    if adapter_cls is not None:
        assert isinstance(adapter, adapter_cls)
    try:
        yield adapter
    finally:
        unpatch_radix_cache()


def step_until(h: CacheHarness, done: Callable[[], bool], max_steps: int = 200) -> None:
    """Step `h` (checking invariants after each step) until `done()`; fail after `max_steps`."""
    for _ in range(max_steps):
        if done():
            return
        h.step()
        check_invariants(h)
    raise AssertionError("condition not reached")


def materialized(flow: Any, rid: str) -> bool:
    """True while request `rid` is live in `flow` and its reused KV has been loaded."""
    state = flow.requests.get(rid)
    return state is not None and state.state is ReuseState.MATERIALIZED


def check_loaded_kv(h: CacheHarness, flow: Any, req: Any) -> int:
    """Every copied piece of ``req`` holds its donor's K rotated by the piece's shift (torch
    reference) and the donor's V, in slots only the request owns; returns the tokens checked.
    Marks them dirty. A donor's KV is read from the tree (all of it resident: asserted) and,
    for a held donor (0.5.23 only), from the held-donor store after its tree part."""
    state = flow.requests[req.rid]
    runtime = flow.runtime
    row = h.row(req)
    spec = runtime.rope_spec(None)
    store = held_of(h.cache)
    checked = 0
    for span, donor in state.loaded_pieces:
        dst = row[span.target_start : span.target_end].to(torch.int64)
        held = None if store is None else store.get(donor)
        tree_end = span.donor_end if held is None else min(span.donor_end, held.held_from)
        path, _ = h.tree_match(flow.donors.tokens(donor)[:tree_end].tolist())
        assert path.numel() == tree_end  # the copied positions were all resident
        if held is not None:  # held-donor KV after the tree part
            path = torch.cat([path, held.slots[: span.donor_end - held.held_from]])
        src = path[span.donor_start : span.donor_end].to(torch.int64)
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


def assert_next_hit_reuses(
    h: CacheHarness,
    flow: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    essay: int = 2,
) -> None:
    """After a fault: a new request (instruction 3 before essay ``essay``'s 8-passage document,
    the document of :func:`tests.harness.traffic.semantic_pair`) reuses a resident donor's KV
    (checked against the torch reference) and completes; then every invariant holds, nothing
    is locked or left in ``flow``."""
    target = h.submit(instructions[3] + document(passages, essay, 8), max_new_tokens=2)
    step_until(h, lambda: materialized(flow, target.rid))
    assert check_loaded_kv(h, flow, target) > 0
    h.run_until_idle()
    assert target.finished()
    check_invariants(h, full_kv=True)
    assert_drained(h)
    assert not flow.requests, "request state left after the next hit"
