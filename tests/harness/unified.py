"""The sglang 0.5.23 part of the cache harness: `UnifiedRadixCache` (Rust or Python tree core).

What `SglangCacheHarness` adds to the shared scheduler loop (tests/harness/driver.py), with the
scheduler code it follows (sglang/srt/managers/scheduler.py of 0.5.23):

* the tree: `UnifiedRadixCache` with one FULL component and `config.tree_core_backend`;
* the chunked stash and unfinished requests: `checkpoint_kv_cache` (scheduler.py:3772);
  finished requests: `release_kv_cache(checkpoint=True)` (batch_result_processor.py:366-395,
  1440-1466);
* admission stops on the adder's budget or when new rows would exceed the free rows
  (scheduler.py:4157);
* aborts follow `Scheduler.abort_request` (scheduler.py:5690-5812): a waiting request is
  dropped (`finish(ABORT)`), a running one gets `to_finish = FINISH_ABORT()` and is released
  (with checkpoint) after its next decode, the chunked request is released without checkpoint
  (scheduler.py:3780-3821);
* retraction follows `Scheduler.update_running_batch` (scheduler.py:4470-4540): when a decode
  step finds too little memory (or a test asks, like sglang's TEST_RETRACT),
  `ScheduleBatch.retract_decode` releases requests without checkpoint and they go back to the
  waiting queue for a new prefill;
* the checker reads the tree through `walk_for_kv_canary` (and the node keys on the Python core).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tests.harness.driver import CacheHarness
from tests.harness.invariants import InvariantViolation, TreeWalk


class SglangCacheHarness(CacheHarness):
    """Real sglang 0.5.23 cache classes on CPU (`UnifiedRadixCache`), driven like `Scheduler`.

    See `CacheHarness` for the interface; `retract_decode` is this version's extra.
    """

    def _make_cache(self) -> Any:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params = CacheInitParams(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.config.page_size,
            disable=False,
            tree_components=(ComponentType.FULL,),
            tree_core_backend=self.config.tree_core_backend,
        )
        return UnifiedRadixCache(params=params)

    def _req_kwargs(self, extra_key: str | None, cache_salt: str | None) -> dict[str, Any]:
        return {"extra_key": extra_key, "cache_salt": cache_salt}

    # ---- requests ---------------------------------------------------------------------------

    def abort(self, req: Any) -> None:
        """Abort `req` following `Scheduler.abort_request` / `process_pending_chunked_abort`."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
        from sglang.srt.mem_cache.common import release_kv_cache

        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
            # Scheduler._release_aborted_request (scheduler.py:3545)
            self.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
            req.finished_reason = FINISH_ABORT()
            return
        if req is self.chunked_req:
            req.finished_reason = FINISH_ABORT("Aborted")
            self.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
            release_kv_cache(req, self.cache, checkpoint=False)
            self.chunked_req = None
            if self.last_prefill_batch is not None and req in self.last_prefill_batch.reqs:
                self.last_prefill_batch.filter_batch(reqs_to_exclude=[req])
            return
        if not req.finished():
            req.to_finish = FINISH_ABORT()

    def retract_decode(self) -> list[Any]:
        """Retract running requests as `Scheduler.update_running_batch` does on a full pool (or
        under TEST_RETRACT): sglang's `retract_decode` picks and releases them (no checkpoint;
        at least one request stays), they are queued again; returns them. Requests it aborts
        instead are dropped from the batch by it and finish here."""
        batch = self.running_batch
        if batch.is_empty():
            return []
        retracted, _, aborted = batch.retract_decode()
        for req in aborted:
            req.finished_reason = req.to_finish
        self.waiting_queue.extend(retracted)
        self.stats["retracted"] = self.stats.get("retracted", 0) + len(retracted)
        return retracted

    def row_index(self, req: Any) -> int:
        return int(req.kv.req_pool_idx)

    def holds_row(self, req: Any) -> bool:
        return bool(req.kv.holds_kv)

    def prefix_len(self, req: Any) -> int:
        return int(req.prefix_len)

    def extend_end(self, req: Any) -> int:
        return int(req.extend_end)

    def kv_bounds(self, req: Any) -> tuple[int, int]:
        return int(req.kv.cache_protected_len), int(req.kv.kv_allocated_len)

    def matched_slots(self, req: Any) -> torch.Tensor:
        n = int(req.prefix_len)
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        slots = self.cache.prefix_device_indices(req).to(torch.int64)
        if slots.numel() != n:
            raise InvariantViolation(f"{req.rid}: prefix_len {n} but {slots.numel()} prefix slots")
        return slots

    # ---- scheduler steps --------------------------------------------------------------------

    def _admission_full(self, adder: Any, allocatable: int) -> bool:
        from sglang.srt.managers.schedule_policy import AddReqResult

        if adder.budget_state() == AddReqResult.OTHER:
            return True
        return sum(not r.kv.holds_kv for r in adder.can_run_list) >= allocatable

    def _checkpoint(self, req: Any, *, chunked: bool) -> None:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        checkpoint_kv_cache(req, self.cache)

    def _release_finished(self, req: Any) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.cache, checkpoint=True)

    def _decode_short_of_memory(self) -> None:
        self.retract_decode()

    # ---- what the checker reads -------------------------------------------------------------

    def free_pages(self) -> torch.Tensor:
        pages = self.allocator.get_all_free_pages()
        return pages.to(torch.int64) if pages is not None else torch.empty(0, dtype=torch.int64)

    def tree_slots(self) -> list[int]:
        values: list[int] = self.cache.all_values_flatten().to(torch.int64).tolist()
        return values

    def tree_walk(self) -> TreeWalk:
        walk = self.cache.tree_core.walk_for_kv_canary(False, False)
        slots = torch.as_tensor(walk.slot_indices, dtype=torch.int64).tolist()
        keys = self._python_tree_keys()
        return TreeWalk(
            slots=slots,
            positions=torch.as_tensor(walk.positions, dtype=torch.int64).tolist(),
            prevs=torch.as_tensor(walk.prev_slot_indices, dtype=torch.int64).tolist(),
            tokens=None if keys is None else [keys[s][0] for s in slots],
            namespaces=None if keys is None else [keys[s][1] for s in slots],
        )

    def _python_tree_keys(self) -> dict[int, tuple[int, int]] | None:
        """slot -> (token id from the node key, namespace id of the node key); None for Rust."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        core = self.cache.tree_core
        if type(core).__name__ != "UnifiedTreeCore":
            return None
        out: dict[int, tuple[int, int]] = {}
        stack = [core.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is core.root_node or node.key is None:
                continue
            value = node.component_data[ComponentType.FULL].value
            if value is None:
                continue
            ns_key = (node.key.extra_key, node.key.cache_salt)
            if ns_key not in self.namespaces:
                raise InvariantViolation(f"tree node under unknown namespace {ns_key}")
            ns = self.namespaces[ns_key]
            for slot, tok in zip(value.tolist(), list(node.key.token_ids), strict=False):
                if slot in out:
                    raise InvariantViolation(f"slot {slot} owned by two tree nodes")
                out[slot] = (int(tok), ns)
        return out

    # ---- the tree, for tests ----------------------------------------------------------------

    def tree_match(
        self, tokens: list[int], extra_key: str | None = None
    ) -> tuple[torch.Tensor, Any]:
        """(device slots, last device node) of the tree's longest match of `tokens`."""
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(array("q", tokens), extra_key=extra_key)
        found = self.cache.match_prefix(MatchPrefixParams(key=key))
        node = found.last_device_node
        return self.cache.path_device_indices(node).to(torch.int64), node

    @contextmanager
    def pinned(self, node: Any) -> Iterator[None]:
        """Lock `node`'s path against eviction for the block (`lock` / `unlock`)."""
        lock = self.cache.lock(node)
        try:
            yield
        finally:
            self.cache.unlock(lock)
