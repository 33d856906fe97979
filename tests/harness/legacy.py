"""The legacy sglang part of the cache harness (0.5.15 - 0.5.18): `RadixCache` on CPU.

What `LegacyCacheHarness` adds to the shared scheduler loop (tests/harness/driver.py), with the
0.5.15 scheduler code it follows (file:line in docs/sglang-legacy.md):

* the tree: `RadixCache`, its LRU clock made logical (`_use_logical_clock`);
* the chunked stash: `maybe_cache_unfinished_req(req, tree, chunked=True)` when its
  `extend_range.end > len(prefix_indices)` (scheduler.py:2616-2627, 2506); unfinished requests
  after a prefill: `maybe_cache_unfinished_req` (-> `cache_unfinished_req`), finished ones
  `release_kv_cache` (-> `cache_finished_req`) (batch_result_processor.py:218-246);
* admission stops when the adder holds as many requests as there are free rows
  (scheduler.py:2811-2918);
* aborts follow `Scheduler.abort_request` (scheduler.py:3866-3979), run for real on a waiting
  request, and `process_pending_chunked_abort` (2509-2551): a running one gets
  `to_finish = FINISH_ABORT()`, the chunked request is released with `is_insert=False`;
* no retraction is mirrored: a decode step short of memory raises;
* the checker reads the tree's node objects, keys and values directly.

Namespaces: 0.5.15's `Req` has no `cache_salt`; its OpenAI layer concatenates cache_salt and
extra_key into `extra_key` (entrypoints/openai/serving_base.py:151-162). `submit` does the same
on versions whose `Req` takes no `cache_salt`. The harness never changes what sglang decides.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tests.harness.driver import CacheHarness, HarnessConfig
from tests.harness.invariants import InvariantViolation, TreeWalk


class _LogicalClock:
    """Stands in for the `time` module inside sglang's radix_cache module: `monotonic()` ticks
    by one per call, so the tree's LRU order (node `last_access_time`) depends only on the
    sequence of operations, not on how loaded the machine is. Everything else is real `time`."""

    def __init__(self) -> None:
        self._tick = 0.0

    def monotonic(self) -> float:
        self._tick += 1.0
        return self._tick

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _use_logical_clock() -> None:
    """Make the legacy tree's eviction order reproducible (idempotent; test process only).

    `RadixCache` stamps nodes with `time.monotonic()` and evicts the least recent leaf, so with
    wall time a randomized run evicts differently under load (materialized counts of 29-37 were
    seen for one seed). 0.5.23's tree cores stamp nodes with a logical counter
    (`get_and_increase_time_counter`), so its harness needs no such help."""
    import sglang.srt.mem_cache.radix_cache as radix_cache

    if not isinstance(radix_cache.time, _LogicalClock):
        radix_cache.time = _LogicalClock()  # type: ignore[assignment]


def _allocated_len(req: Any) -> int:
    """`req.kv_allocated_len` (0.5.15) or `req.kv.kv_allocated_len` (0.5.16 - 0.5.18)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "kv_allocated_len"):
        return int(kv.kv_allocated_len)
    return int(req.kv_allocated_len)


def _req_takes_cache_salt() -> bool:
    from sglang.srt.managers.schedule_batch import Req

    return "cache_salt" in inspect.signature(Req.__init__).parameters


class _SchedulerView:
    """The part of a 0.5.15 ``Scheduler`` that ``Scheduler.abort_request`` reads for a request in
    the waiting queue, backed by the harness (no disaggregation, no HiCache storage, no grammar
    backend; the tokenizer channel is a sink)."""

    def __init__(self, h: LegacyCacheHarness) -> None:
        from types import SimpleNamespace

        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.chunked_req = h.chunked_req
        self.waiting_queue = h.waiting_queue  # the same list: the scheduler pops from it
        self.enable_hicache_storage = False
        self.tree_cache = h.cache
        self.disaggregation_mode = DisaggregationMode.NULL
        self.running_batch = h.running_batch
        self.cur_batch = None
        self.sent: list[Any] = []
        self.ipc_channels = SimpleNamespace(
            send_to_tokenizer=SimpleNamespace(send_output=lambda *a, **k: self.sent.append(a))
        )
        self.grammar_manager = SimpleNamespace(abort_requests=lambda _req: None)
        # read by 0.5.18's abort_request: no diffusion LLM, one pipeline stage
        self.dllm_config = None
        self.ps = SimpleNamespace(pp_size=1)
        self.last_batch = None
        self._pending_chunked_abort_req = None


class LegacyCacheHarness(CacheHarness):
    """Real legacy sglang cache classes on CPU (`RadixCache`), driven like the 0.5.15 `Scheduler`.

    See `CacheHarness` for the interface. `config.tree_core_backend` is ignored.
    """

    rid_format = "h{:08d}"  # no rid a prefix of another: aborts match by prefix

    def __init__(self, config: HarnessConfig, model_config: Any) -> None:
        _use_logical_clock()
        self._cache_salt_field = _req_takes_cache_salt()
        super().__init__(config, model_config)

    def _make_cache(self) -> Any:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache

        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.config.page_size,
        )
        return RadixCache(params)

    def _req_kwargs(self, extra_key: str | None, cache_salt: str | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"vocab_size": self.vocab_size}  # as the scheduler passes it
        if self._cache_salt_field:
            kwargs.update(extra_key=extra_key, cache_salt=cache_salt)
        else:  # serving_base._compute_extra_key: cache_salt + extra_key
            kwargs["extra_key"] = "".join(p for p in (cache_salt, extra_key) if p) or None
        return kwargs

    # ---- requests ---------------------------------------------------------------------------

    def abort(self, req: Any) -> None:
        """Abort `req` following `Scheduler.abort_request` / `process_pending_chunked_abort`."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.common import release_kv_cache

        if req in self.waiting_queue:
            # The real Scheduler.abort_request pops it (scheduler.py:3874-3901) and touches no
            # cache for it; the view gives that method the scheduler state it reads.
            from sglang.srt.managers.io_struct import AbortReq
            from sglang.srt.managers.scheduler import Scheduler

            Scheduler.abort_request(_SchedulerView(self), AbortReq(rid=req.rid))
            assert req not in self.waiting_queue
            req.finished_reason = FINISH_ABORT()
            return
        if req is self.chunked_req:
            req.finished_reason = FINISH_ABORT("Aborted")
            req.to_finish = None
            if req.req_pool_idx is not None and not getattr(req, "kv_committed_freed", False):
                release_kv_cache(req, self.cache, is_insert=False)
            self.chunked_req = None
            if self.last_prefill_batch is not None and req in self.last_prefill_batch.reqs:
                self.last_prefill_batch.filter_batch(chunked_req_to_exclude=[req])
            return
        if not req.finished():
            req.to_finish = FINISH_ABORT()

    def row_index(self, req: Any) -> int:
        return int(req.req_pool_idx)

    def holds_row(self, req: Any) -> bool:
        return req.req_pool_idx is not None

    def prefix_len(self, req: Any) -> int:
        return len(req.prefix_indices)

    def extend_end(self, req: Any) -> int:
        return int(req.extend_range.end)

    def kv_bounds(self, req: Any) -> tuple[int, int]:
        return int(req.cache_protected_len), _allocated_len(req)

    def matched_slots(self, req: Any) -> torch.Tensor:
        return req.prefix_indices.to(torch.int64)

    # ---- scheduler steps --------------------------------------------------------------------

    def _admission_full(self, adder: Any, allocatable: int) -> bool:
        return len(adder.can_run_list) >= allocatable

    def _checkpoint(self, req: Any, *, chunked: bool) -> None:
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

        if chunked:
            maybe_cache_unfinished_req(req, self.cache, chunked=True)
        else:
            maybe_cache_unfinished_req(req, self.cache)

    def _release_finished(self, req: Any) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.cache)

    def _decode_short_of_memory(self) -> None:
        raise RuntimeError("decode ran out of KV memory; retraction is not mirrored")

    # ---- what the checker reads -------------------------------------------------------------

    def free_pages(self) -> torch.Tensor:
        a = self.allocator
        return torch.cat([a.free_pages, a.release_pages]).to(torch.int64)

    def tree_slots(self) -> list[int]:
        if not self.cache.root_node.children:
            return []  # all_values_flatten concatenates nothing
        values: list[int] = self.cache.all_values_flatten().to(torch.int64).tolist()
        return values

    def tree_walk(self) -> TreeWalk:
        """Every device slot of the tree with its position, previous slot on its path, token id
        and namespace id (read from the node keys); raises on a slot owned twice."""
        slots: list[int] = []
        positions: list[int] = []
        prevs: list[int] = []
        tokens: list[int] = []
        nss: list[int] = []
        seen: set[int] = set()
        stack = [(child, 0, -1) for child in self.cache.root_node.children.values()]
        while stack:
            node, depth, prev = stack.pop()
            key = node.key
            ns_key = (key.extra_key, getattr(key, "cache_salt", None))
            if ns_key not in self.namespaces:
                raise InvariantViolation(f"tree node under unknown namespace {ns_key}")
            ns = self.namespaces[ns_key]
            token_ids = list(key.token_ids)[: len(key)]
            last = prev
            if node.value is not None:
                vals = node.value.to(torch.int64).tolist()
                if len(vals) != len(token_ids):
                    raise InvariantViolation(
                        f"node with {len(token_ids)} tokens holds {len(vals)} slots"
                    )
                for i, (slot, tok) in enumerate(zip(vals, token_ids, strict=True)):
                    if slot in seen:
                        raise InvariantViolation(f"slot {slot} owned by two tree nodes")
                    seen.add(slot)
                    slots.append(slot)
                    positions.append(depth + i)
                    prevs.append(last)
                    tokens.append(int(tok))
                    nss.append(ns)
                    last = slot
            for child in node.children.values():
                stack.append((child, depth + len(token_ids), last))
        return TreeWalk(slots, positions, prevs, tokens, nss)

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
        return found.device_indices.to(torch.int64), found.last_device_node

    @contextmanager
    def pinned(self, node: Any) -> Iterator[None]:
        """Lock `node`'s path against eviction for the block (`inc_lock_ref` / `dec_lock_ref`)."""
        self.cache.inc_lock_ref(node)
        try:
            yield
        finally:
            self.cache.dec_lock_ref(node)
