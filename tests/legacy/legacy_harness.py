"""Cache-level harness for the legacy sglang tree (0.5.15 - 0.5.18): `RadixCache` on CPU.

The legacy counterpart of tests/sglang_harness.py (read that module's doc first): the real
`ReqToTokenPool`, `MHATokenToKVPool`, `TokenToKVPoolAllocator` (`PagedTokenToKVPoolAllocator` for
page_size > 1), `RadixCache`, `Req`, `PrefillAdder` and `ScheduleBatch` on device ``cpu``, moved
through the steps `Scheduler.get_next_batch_to_run` takes in 0.5.15 (file:line in
docs/sglang-legacy.md):

* stash the chunked request of the previous step: `maybe_cache_unfinished_req(req, tree,
  chunked=True)` when its `extend_range.end > len(prefix_indices)` (scheduler.py:2616-2627, 2506);
* merge the previous prefill batch into the running batch (`filter_batch(chunked_req_to_exclude=)`,
  `merge_batch`);
* admission with the real `PrefillAdder` (scheduler.py:2811-2918): `chunked_req.
  init_next_round_input()` + `add_chunked_req`, then per waiting request
  `init_next_round_input(tree_cache)` (which calls `RadixCache.match_prefix` and sets
  `prefix_indices`, `last_node`, `cache_protected_len`) and `add_one_req` (which locks
  `req.last_node`);
* `ScheduleBatch.init_new(...).prepare_for_extend()`, i.e. sglang's own `alloc_for_extend`
  (mem_cache/common.py:452), which evicts through `evict_from_tree_cache` when short;
* the "forward": deterministic KV written into the pool for the positions the batch computes
  (`cold_kv` of tests/sglang_harness.py, the same chained model): [prefix_len, extend end), or a
  sparse request's kept positions (semblend's one-pass extend), with `out_cache_loc`,
  `prefill_input_ids_cpu` and `extend_lens` checked against them;
* the prefill result (batch_result_processor.py:218-246): append the next token,
  `update_finish_state`, then `release_kv_cache` (-> `cache_finished_req`) or
  `maybe_cache_unfinished_req` (-> `cache_unfinished_req`);
* with no prefill to run, a decode step: `prepare_for_decode`, KV for the decoded token,
  `release_kv_cache` for finished requests.

Aborts follow `Scheduler.abort_request` (scheduler.py:3866-3979) and
`process_pending_chunked_abort` (2509-2551): a waiting request is dropped, a running one gets
`to_finish = FINISH_ABORT()`, the chunked request is released with `is_insert=False`.

Namespaces: 0.5.15's `Req` has no `cache_salt`; its OpenAI layer concatenates cache_salt and
extra_key into `extra_key` (entrypoints/openai/serving_base.py:151-162). `submit` does the same
on versions whose `Req` takes no `cache_salt`. The harness never changes what sglang decides.
"""

from __future__ import annotations

import inspect
import time
from array import array
from collections.abc import Sequence
from typing import Any

import torch
from sglang_harness import (
    _FIELD_HASH,
    _HASH_MODULUS,
    _HASH_MULTIPLIER,
    HarnessConfig,
    InvariantViolation,
    MatchHook,
    StepReport,
    _expect_cold,
    _fail_where,
    chain_hash,
    chain_hashes,
    namespace_seed,
)

__all__ = [
    "HarnessConfig",
    "InvariantViolation",
    "LegacyCacheHarness",
    "MatchHook",
    "StepReport",
    "check_exact_match",
    "check_invariants",
]


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


class LegacyCacheHarness:
    """Real legacy sglang cache classes on CPU, driven like the 0.5.15 `Scheduler` drives them.

    Same interface as `SglangCacheHarness` (`submit`, `step`, `abort`, `run_until_idle`,
    `waiting_queue`, `chunked_req`, `running_batch`, `stats`, `match_hook`, ...), so the drivers of
    tests/test_sglang_harness.py run unchanged. `config.tree_core_backend` is ignored.
    """

    def __init__(self, config: HarnessConfig, model_config: Any) -> None:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        _use_logical_clock()
        self.config = config
        self.model_config = model_config
        self.head_num = int(model_config.num_key_value_heads)
        self.head_dim = int(model_config.head_dim)
        self.vocab_size = int(model_config.vocab_size)
        ps = config.page_size
        server_args = ServerArgs(
            model_path=str(model_config.model_path),
            page_size=ps,
            chunked_prefill_size=config.chunked_prefill_size or -1,
            device="cpu",
        )
        set_global_server_args_for_scheduler(server_args)
        self.req_to_token_pool = ReqToTokenPool(
            size=config.max_running_requests,
            max_context_len=config.max_context_len,
            device="cpu",
            enable_memory_saver=False,
        )
        self.kv_pool = MHATokenToKVPool(
            size=config.pool_tokens,
            page_size=ps,
            dtype=torch.float32,
            head_num=self.head_num,
            head_dim=self.head_dim,
            layer_num=config.num_layers,
            device="cpu",
            enable_memory_saver=False,
        )
        allocator_cls: Any = TokenToKVPoolAllocator if ps == 1 else PagedTokenToKVPoolAllocator
        kwargs: dict[str, Any] = {} if ps == 1 else {"page_size": ps}
        self.allocator: Any = allocator_cls(
            size=config.pool_tokens,
            dtype=torch.float32,
            device="cpu",
            kvcache=self.kv_pool,
            need_sort=False,
            **kwargs,
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=ps,
        )
        self.cache = RadixCache(params)
        self._cache_salt_field = _req_takes_cache_salt()
        self._schedule_batch_cls = ScheduleBatch
        self._spec_none = SpeculativeAlgorithm.NONE
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.waiting_queue: list[Any] = []
        self.chunked_req: Any = None
        self.last_prefill_batch: Any = None
        self.namespaces: dict[tuple[str | None, str | None], int] = {(None, None): 1}
        self.match_hook: MatchHook | None = None
        self.pending_violations: list[InvariantViolation] = []
        slots_total = config.pool_tokens + config.page_size
        self.verified_fields = torch.full((slots_total, 4), -1, dtype=torch.int64)
        self.dirty = torch.zeros(slots_total, dtype=torch.bool)
        self.checks_run = 0
        self.stats = {"requests": 0, "prefix_hits": 0, "hit_tokens": 0, "evicted_steps": 0}
        self._hit_rids: set[str] = set()
        self._next_rid = 0

    # ---- requests ---------------------------------------------------------------------------

    def namespace_id(self, extra_key: str | None, cache_salt: str | None = None) -> int:
        """Stable small id of the (extra_key, cache_salt) namespace as the tree keys it."""
        key = (extra_key, cache_salt)
        if key not in self.namespaces:
            self.namespaces[key] = len(self.namespaces) + 1
        return self.namespaces[key]

    def _ns_of(self, req: Any) -> int:
        return self.namespace_id(req.extra_key, getattr(req, "cache_salt", None))

    def submit(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int = 1,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> Any:
        """Queue a real `Req` (greedy) as `Scheduler.handle_generate_request` would; return it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
        sp.normalize(None)
        kwargs: dict[str, Any] = {}
        if self._cache_salt_field:
            kwargs = {"extra_key": extra_key, "cache_salt": cache_salt}
        else:  # serving_base._compute_extra_key: cache_salt + extra_key
            kwargs = {"extra_key": "".join(p for p in (cache_salt, extra_key) if p) or None}
        req = Req(
            rid=f"h{self._next_rid:08d}",  # no rid a prefix of another: aborts match by prefix
            origin_input_text="",
            origin_input_ids=array("q", [int(t) for t in token_ids]),
            sampling_params=sp,
            vocab_size=self.vocab_size,  # as Scheduler.handle_generate_request passes it
            **kwargs,
        )
        req.logprob_start_len = -1
        self._next_rid += 1
        self._ns_of(req)
        self.waiting_queue.append(req)
        self.stats["requests"] += 1
        return req

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

    def live_requests(self) -> list[Any]:
        """Requests that hold a req_to_token row now (running, chunked, or just prefilled)."""
        seen: dict[int, Any] = {}
        for batch in (self.running_batch, self.last_prefill_batch):
            if batch is None:
                continue
            for r in batch.reqs:
                if r.req_pool_idx is not None:
                    seen[id(r)] = r
        if self.chunked_req is not None and self.chunked_req.req_pool_idx is not None:
            seen[id(self.chunked_req)] = self.chunked_req
        return list(seen.values())

    def idle(self) -> bool:
        """No request waits, runs, or is mid-prefill."""
        return (
            not self.waiting_queue
            and self.chunked_req is None
            and not self.live_requests()
            and (self.last_prefill_batch is None or self.last_prefill_batch.is_empty())
        )

    # ---- one scheduler iteration ------------------------------------------------------------

    def step(self) -> StepReport:
        """One `get_next_batch_to_run` + forward + result processing iteration."""
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.chunked_req.extend_range.end > len(self.chunked_req.prefix_indices):
                maybe_cache_unfinished_req(self.chunked_req, self.cache, chunked=True)
        if self.last_prefill_batch is not None:
            last = self.last_prefill_batch
            self.last_prefill_batch = None
            last.filter_batch(chunked_req_to_exclude=exclude)
            if not last.is_empty():
                if self.running_batch.is_empty():
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)
        self.running_batch.filter_batch()
        if self.running_batch.is_empty():
            self.running_batch = self._schedule_batch_cls(reqs=[], batch_is_full=False)

        batch, report = self._new_prefill_batch()
        if batch is not None:
            self._forward_extend(batch)
            self._process_prefill_result(batch, report)
            self.last_prefill_batch = batch
            return report
        if not self.running_batch.is_empty():
            return self._decode_step()
        return StepReport(kind="idle")

    def run_until_idle(self, max_steps: int = 10_000, check: bool = True) -> int:
        """Step until `idle()`, checking invariants after every step; return the step count."""
        steps = 0
        while not self.idle():
            self.step()
            if check:
                check_invariants(self)
            steps += 1
            if steps >= max_steps:
                raise RuntimeError("harness did not drain")
        return steps

    def _new_prefill_batch(self) -> tuple[Any, StepReport]:
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        report = StepReport(kind="prefill")
        if not self.waiting_queue and self.chunked_req is None:
            return None, report
        adder = PrefillAdder(
            self.config.page_size,
            self.cache,
            self.allocator,
            self.running_batch,
            self.config.new_token_ratio,
            self.config.max_prefill_tokens,
            self.config.chunked_prefill_size,
        )
        if self.chunked_req is not None:
            # Continuations are not re-matched (scheduler.py:2834-2836).
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        # Scheduler.get_num_allocatable_reqs: free req_to_token rows (running rows are held).
        allocatable = self.req_to_token_pool.available_size()
        for req in list(self.waiting_queue):
            if len(adder.can_run_list) >= allocatable:
                break
            req.init_next_round_input(self.cache)
            if self.match_hook is not None:
                self.match_hook(self, req)
            self._record_match(req)
            res = adder.add_one_req(
                req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None
            )
            if res != AddReqResult.CONTINUE:
                break
        can_run = list(adder.can_run_list)
        if not can_run:
            return None, report
        can_run_ids = {id(r) for r in can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in can_run_ids]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = self._schedule_batch_cls.init_new(
            can_run,
            self.req_to_token_pool,
            self.allocator,
            self.cache,
            self.model_config,
            False,
            self._spec_none,
            chunked_req=self.chunked_req,
        )
        evictable_before = self.cache.evictable_size()
        batch.prepare_for_extend()
        if self.cache.evictable_size() < evictable_before:
            self.stats["evicted_steps"] += 1
        report.admitted = can_run
        report.chunked = self.chunked_req
        return batch, report

    def _record_match(self, req: Any) -> None:
        n = len(req.prefix_indices)
        if n <= 0:
            return
        if req.rid not in self._hit_rids:  # a waiting request is re-matched every step
            self._hit_rids.add(req.rid)
            self.stats["prefix_hits"] += 1
            self.stats["hit_tokens"] += n
        try:
            check_exact_match(self, req)
        except InvariantViolation as err:
            self.pending_violations.append(err)

    # ---- forward stand-in -------------------------------------------------------------------

    def mark_dirty(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Tell the checker these pool slots were written (by anything but sglang itself)."""
        idx = torch.as_tensor(slots, dtype=torch.int64)
        self.dirty[idx] = True

    def _stored_hash(self, slot: int) -> int:
        return int(self.kv_pool.k_buffer[0][slot, 0, _FIELD_HASH].item())

    def _write_kv(self, req: Any, start: int, end: int) -> None:
        """Compute and store KV for positions [start, end) of `req`'s row, reading h_{start-1}."""
        if end <= start:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        slots = row[start:end].to(torch.int64)
        ns = self._ns_of(req)
        prev = self._stored_hash(int(row[start - 1])) if start > 0 else namespace_seed(ns)
        tokens = list(req.full_untruncated_fill_ids[start:end])
        hashes = chain_hashes(prev, tokens)
        self._store(slots, tokens, range(start, end), hashes, ns)

    def _store(
        self,
        slots: torch.Tensor,
        tokens: Sequence[int],
        positions: Sequence[int],
        hashes: Sequence[int],
        ns: int,
    ) -> None:
        from sglang_harness import cold_kv

        n = slots.numel()
        t = torch.tensor(list(tokens), dtype=torch.int64)
        p = torch.tensor(list(positions), dtype=torch.int64)
        h = torch.tensor(list(hashes), dtype=torch.int64)
        s = torch.full((n,), ns, dtype=torch.int64)
        self.mark_dirty(slots)
        for layer in range(self.config.num_layers):
            k, v = cold_kv(t, p, h, s, layer, self.head_num, self.head_dim)
            self.kv_pool.k_buffer[layer][slots] = k
            self.kv_pool.v_buffer[layer][slots] = v

    def _next_token(self, req: Any, position: int) -> int:
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        h = self._stored_hash(int(row[position]))
        return 1000 + h % (self.vocab_size - 2000)

    def _forward_extend(self, batch: Any) -> None:
        """Write KV for the positions the batch computes: [prefix_len, extend_range.end), or, for
        a sparse request (semblend's one-pass extend), its kept positions in ascending order,
        each reading the KV stored at the position before it (as tests/sglang_harness.py does
        for 0.5.23). Checks that ``out_cache_loc`` holds exactly the row's slots at those
        positions, in batch order, and that ``prefill_input_ids_cpu`` holds their tokens."""
        from semblend_sglang.patches.sglang.one_pass import SPARSE_ATTR

        sparse = getattr(batch, SPARSE_ATTR, None) or {}
        expected_loc: list[torch.Tensor] = []
        expected_ids: list[torch.Tensor] = []
        for req in batch.reqs:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            positions = sparse.get(req.rid)
            if positions is None:
                positions = torch.arange(len(req.prefix_indices), int(req.extend_range.end))
            positions = positions.to(torch.int64)
            expected_loc.append(row[positions].to(torch.int64))
            fill = torch.tensor(list(req.full_untruncated_fill_ids), dtype=torch.int64)
            expected_ids.append(fill[positions])
            runs = torch.tensor_split(
                positions, (torch.diff(positions) != 1).nonzero().flatten() + 1
            )
            for run in runs:
                if run.numel():
                    self._write_kv(req, int(run[0]), int(run[-1]) + 1)
        got = batch.out_cache_loc.to(torch.int64)
        want = torch.cat(expected_loc) if expected_loc else got
        ids = batch.prefill_input_ids_cpu
        want_ids = torch.cat(expected_ids) if expected_ids else ids
        if not torch.equal(got, want):
            self.pending_violations.append(
                InvariantViolation("out_cache_loc is not the row's slots at the computed positions")
            )
        elif ids is None or not torch.equal(ids.to(torch.int64), want_ids):
            self.pending_violations.append(
                InvariantViolation("prefill_input_ids_cpu is not the computed positions' tokens")
            )
        elif int(batch.extend_num_tokens) != int(got.numel()) or sum(batch.extend_lens) != int(
            got.numel()
        ):
            self.pending_violations.append(
                InvariantViolation("extend_lens / extend_num_tokens disagree with out_cache_loc")
            )

    def _process_prefill_result(self, batch: Any, report: StepReport) -> None:
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req, release_kv_cache

        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(self._next_token(req, int(req.extend_range.end) - 1))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.cache)
                report.finished.append(req)
            else:
                maybe_cache_unfinished_req(req, self.cache)

    def _decode_step(self) -> StepReport:
        from sglang.srt.mem_cache.common import release_kv_cache

        report = StepReport(kind="decode")
        batch = self.running_batch
        if not batch.check_decode_mem():
            raise RuntimeError("decode ran out of KV memory; retraction is not mirrored")
        batch.prepare_for_decode()
        for i, req in enumerate(batch.reqs):
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            assert int(row[pos]) == int(batch.out_cache_loc[i]), (req.rid, pos)
            ns = self._ns_of(req)
            prev = self._stored_hash(int(row[pos - 1]))
            h = chain_hash(prev, int(req.output_ids[-1]))
            self._store(row[pos : pos + 1].to(torch.int64), [req.output_ids[-1]], [pos], [h], ns)
        for req in batch.reqs:
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            req.output_ids.append(self._next_token(req, pos))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.cache)
                report.finished.append(req)
        batch.filter_batch()
        return report


# ---- invariant checker ------------------------------------------------------------------------


def _free_pages(h: LegacyCacheHarness) -> torch.Tensor:
    a = h.allocator
    return torch.cat([a.free_pages, a.release_pages]).to(torch.int64)


def _tree_walk(
    h: LegacyCacheHarness,
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Every device slot of the tree with its position, previous slot on its path (-1 at the
    root), token id and namespace id (read from the node keys); raises on a slot owned twice."""
    slots: list[int] = []
    positions: list[int] = []
    prevs: list[int] = []
    tokens: list[int] = []
    nss: list[int] = []
    seen: set[int] = set()
    stack = [(child, 0, -1) for child in h.cache.root_node.children.values()]
    while stack:
        node, depth, prev = stack.pop()
        key = node.key
        ns_key = (key.extra_key, getattr(key, "cache_salt", None))
        if ns_key not in h.namespaces:
            raise InvariantViolation(f"tree node under unknown namespace {ns_key}")
        ns = h.namespaces[ns_key]
        token_ids = list(key.token_ids)[: len(key)]
        value = node.value
        last = prev
        if value is not None:
            vals = value.to(torch.int64).tolist()
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
    return slots, positions, prevs, tokens, nss


def check_invariants(h: LegacyCacheHarness, *, full_kv: bool = False) -> None:
    """Raise `InvariantViolation` if the cache state breaks any safety rule.

    The checks of tests/sglang_harness.py `check_invariants`, on the legacy tree (whose node
    objects, keys and values are read directly): free + tree + request pages == pool, pairwise
    disjoint; no duplicate in the free list; no slot owned by two tree nodes; every tree slot
    holds the KV a cold prefill of its own token path produces (chain check, then full K/V of
    new, moved or dirty slots, or all with `full_kv` / every 20th check); a tree path keeps one
    namespace; every exact match since the last check returned cold KV of the request's own
    tokens in its own namespace (`check_exact_match`). Reads only.
    """
    pending, h.pending_violations = h.pending_violations, []
    if pending:
        raise pending[0]
    ps = h.config.page_size
    num_pages = h.config.pool_tokens // ps
    free_list = _free_pages(h).tolist()
    free_set = set(free_list)
    if len(free_set) != len(free_list):
        raise InvariantViolation(
            f"free list holds duplicates: {len(free_list)} entries, {len(free_set)} distinct"
        )
    if len(free_list) > num_pages:
        raise InvariantViolation(f"free list ({len(free_list)}) exceeds pool ({num_pages})")

    walk = _tree_walk(h)
    tree_values = h.cache.all_values_flatten().to(torch.int64).tolist() if walk[0] else []
    tree_slot_set = set(tree_values)
    if len(tree_slot_set) != len(tree_values):
        dup = len(tree_values) - len(tree_slot_set)
        raise InvariantViolation(f"{dup} slots owned by two tree nodes")
    tree_pages = {s // ps for s in tree_values}

    req_pages: set[int] = set()
    for req in h.live_requests():
        row = h.req_to_token_pool.req_to_token[req.req_pool_idx]
        lo, hi = int(req.cache_protected_len), _allocated_len(req)
        tree_part = row[:lo].to(torch.int64).tolist()
        if any(s not in tree_slot_set for s in tree_part):
            raise InvariantViolation(f"{req.rid}: protected prefix slots not owned by the tree")
        owned = {int(s) // ps for s in row[lo:hi].tolist()}
        if owned & req_pages:
            raise InvariantViolation(f"{req.rid}: slots shared with another live request")
        if owned & tree_pages:
            raise InvariantViolation(f"{req.rid}: request-owned slots also owned by the tree")
        req_pages |= owned
    for name, owned_set in (("tree", tree_pages), ("request", req_pages)):
        both = owned_set & free_set
        if both:
            raise InvariantViolation(f"{len(both)} {name}-owned pages are also free")
    total = len(free_set) + len(tree_pages) + len(req_pages)
    if total != num_pages or (free_set | tree_pages | req_pages) != set(range(1, num_pages + 1)):
        raise InvariantViolation(
            f"free {len(free_set)} + tree {len(tree_pages)} + requests {len(req_pages)} "
            f"= {total} != pool {num_pages} pages"
        )

    h.checks_run += 1
    _check_tree_kv(h, walk, tree_slot_set, full_kv or h.checks_run % 20 == 0)


def _check_tree_kv(
    h: LegacyCacheHarness,
    walk: tuple[list[int], list[int], list[int], list[int], list[int]],
    tree_slot_set: set[int],
    full_kv: bool,
) -> None:
    """Chain check of every tree slot by induction over the parent links (as in
    tests/sglang_harness.py `_check_tree_kv`), with tokens and namespaces from the node keys."""
    slots_l, positions_l, prevs_l, tokens_l, ns_l = walk
    if set(slots_l) != tree_slot_set or len(slots_l) != len(tree_slot_set):
        raise InvariantViolation("tree walk and all_values_flatten disagree on tree slots")
    if not slots_l:
        return
    slots = torch.tensor(slots_l, dtype=torch.int64)
    positions = torch.tensor(positions_l, dtype=torch.int64)
    prevs = torch.tensor(prevs_l, dtype=torch.int64)
    stored = h.kv_pool.k_buffer[0][slots, 0, :4].to(torch.int64)
    stok, spos, shash, sns = stored.unbind(1)
    tok = torch.tensor(tokens_l, dtype=torch.int64)
    key_ns = torch.tensor(ns_l, dtype=torch.int64)
    _fail_where(h, stok != tok, slots, positions, "holds KV of another token than its node")
    _fail_where(h, sns != key_ns, slots, positions, "holds KV of another namespace")
    _fail_where(h, spos != positions, slots, positions, "holds KV of another position")
    row_of = torch.full((h.dirty.numel(),), -1, dtype=torch.int64)
    row_of[slots] = torch.arange(slots.numel())
    has_parent = prevs >= 0
    parent_row = torch.where(has_parent, row_of[prevs.clamp(min=0)], 0)
    _fail_where(h, has_parent & (parent_row < 0), slots, positions, "parent slot not in tree")
    _fail_where(h, ~has_parent & (positions != 0), slots, positions, "root child not at 0")
    seed = (key_ns * 7_919 + 1) % _HASH_MODULUS
    prev_hash = torch.where(has_parent, shash[parent_row], seed)
    prev_ns = torch.where(has_parent, key_ns[parent_row], key_ns)
    want_hash = (prev_hash * _HASH_MULTIPLIER + tok + 1) % _HASH_MODULUS
    _fail_where(h, prev_ns != key_ns, slots, positions, "namespace differs from its parent's")
    _fail_where(h, want_hash != shash, slots, positions, "holds approximate KV (context)")
    fields = torch.stack([positions, shash, tok, key_ns], dim=1)
    changed = (h.verified_fields[slots] != fields).any(1) | h.dirty[slots]
    sel = torch.arange(slots.numel()) if full_kv else changed.nonzero().flatten()
    if sel.numel():
        _expect_cold(
            h,  # type: ignore[arg-type]
            slots[sel].tolist(),
            tok[sel].tolist(),
            positions[sel].tolist(),
            shash[sel].tolist(),
            key_ns[sel].tolist(),
            "tree KV",
        )
        h.verified_fields[slots[sel]] = fields[sel]
        h.dirty[slots[sel]] = False


def check_exact_match(h: LegacyCacheHarness, req: Any) -> None:
    """Raise `InvariantViolation` unless `req`'s matched prefix holds cold KV of its own tokens.

    Callers: the harness right after `init_next_round_input` set `req.prefix_indices`.
    """
    slots = req.prefix_indices.to(torch.int64)
    n = int(slots.numel())
    if n <= 0:
        return
    tokens = [int(t) for t in req.full_untruncated_fill_ids[:n]]
    ns = h._ns_of(req)
    hashes = chain_hashes(namespace_seed(ns), tokens)
    _expect_cold(
        h,  # type: ignore[arg-type]
        slots.tolist(),
        tokens,
        list(range(n)),
        hashes,
        [ns] * n,
        f"exact match of {req.rid} (namespace {req.extra_key!r})",
    )
