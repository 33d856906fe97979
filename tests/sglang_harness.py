"""Cache-level harness: the real sglang 0.5.23 KV-cache classes driven on CPU like the scheduler.

`SglangCacheHarness` builds the real `ReqToTokenPool`, `MHATokenToKVPool`,
`TokenToKVPoolAllocator` (`PagedTokenToKVPoolAllocator` when page_size > 1) and
`UnifiedRadixCache` on device ``cpu``, and moves real `Req` objects through the steps
`Scheduler.get_next_batch_to_run` takes (sglang/srt/managers/scheduler.py:3894):

* stash the chunked request of the previous step: `checkpoint_kv_cache` (scheduler.py:3772);
* merge the previous prefill batch into the running batch (`filter_batch`, `merge_batch`);
* admission with the real `PrefillAdder` (scheduler.py:4157): `chunked_req.init_next_round_input()`
  + `add_chunked_req`, then per waiting request `init_next_round_input(tree_cache)`, which calls
  `match_kv_cache` (mem_cache/common.py:221), and `add_one_req`, which locks `req.last_node`;
* `ScheduleBatch.init_new(...).prepare_for_extend()`, which runs sglang's own `alloc_for_extend`
  (eviction through `evict_from_tree_cache` when the allocator runs short);
* the "forward": deterministic KV written into the pool for the extend slots (`cold_kv`);
* the prefill result (batch_result_processor.py:366-395): append the next token,
  `update_finish_state`, then `release_kv_cache(checkpoint=True)` or `checkpoint_kv_cache`;
* with no prefill to run, a decode step: `prepare_for_decode` (sglang's `alloc_for_decode`),
  KV for the decoded token, `release_kv_cache(checkpoint=True)` for finished requests
  (batch_result_processor.py:1440-1466).

Aborts follow `Scheduler.abort_request` (scheduler.py:5690-5812): a waiting request is dropped, a
running one gets `to_finish = FINISH_ABORT()` and is released (with checkpoint) after its next
decode, the chunked request is released without checkpoint (scheduler.py:3780-3821).

Retraction follows `Scheduler.update_running_batch` (scheduler.py:4470-4540): when a decode step
finds too little memory (or a test asks, like sglang's TEST_RETRACT), `ScheduleBatch.retract_decode`
releases requests without checkpoint and they go back to the waiting queue for a new prefill.

Deterministic KV model: K/V at position p is a function of (token, p, layer, namespace, h_p) where
h_p = H(h_{p-1}, token_p) chains through the KV the request attends to (h_{p-1} is read back from
the pool slot at p-1 of the request's own row). A prefix KV that came from other tokens therefore
propagates into everything computed after it, as it does in a real model, and a slot's KV is
"cold" exactly when it equals `cold_kv` of its own token path.

The harness never changes what sglang decides; it only observes. It is test code, not shipped.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

NAMESPACE_NONE: tuple[str | None, str | None] = (None, None)
_HASH_MODULUS = 8_388_593  # prime below 2**23: every value stays exact in float32
_HASH_MULTIPLIER = 1_000_003
_FIELD_TOKEN, _FIELD_POS, _FIELD_HASH, _FIELD_NS, _FIELD_LAYER = 0, 1, 2, 3, 4


class InvariantViolation(AssertionError):
    """Raised by `check_invariants` when the cache state breaks a safety rule."""


def namespace_seed(ns_id: int) -> int:
    """Chain value before position 0 for namespace `ns_id` (the model's initial state)."""
    return (ns_id * 7_919 + 1) % _HASH_MODULUS


def chain_hash(prev: int, token: int) -> int:
    """h_p = H(h_{p-1}, token_p): the context summary the deterministic model carries."""
    return (prev * _HASH_MULTIPLIER + token + 1) % _HASH_MODULUS


def chain_hashes(prev: int, tokens: Sequence[int]) -> list[int]:
    """All h_p for `tokens`, starting after chain value `prev`."""
    out: list[int] = []
    h = prev
    for t in tokens:
        h = chain_hash(h, int(t))
        out.append(h)
    return out


def cold_kv(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    hashes: torch.Tensor,
    ns_ids: torch.Tensor,
    layer: int,
    head_num: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([n, head_num, head_dim], float32) a cold prefill writes for these tokens.

    Pure function of its arguments; every value is an integer below 2**23, so exact in float32.
    Fields 0-4 of K carry token, position, chain hash, namespace and layer for decoding.
    """
    n = tokens.numel()
    t = tokens.to(torch.int64)
    p = positions.to(torch.int64)
    h = hashes.to(torch.int64)
    s = ns_ids.to(torch.int64)
    base = torch.arange(head_num, dtype=torch.float32).view(head_num, 1) * 67.0 + torch.arange(
        head_dim, dtype=torch.float32
    ).view(1, head_dim)
    k_row = (t * 7 + p * 13 + (h % 1009) * 3 + s * 29 + layer * 17).to(torch.float32)
    v_row = (t * 5 + p * 11 + (h % 997) * 2 + s * 31 + layer * 3).to(torch.float32)
    k = k_row.view(n, 1, 1) + base
    v = v_row.view(n, 1, 1) - base
    fields = torch.stack([t, p, h, s, torch.full_like(t, layer)], dim=1).to(torch.float32)
    k[:, :, :5] = fields.view(n, 1, 5)
    v[:, :, 0] = h.to(torch.float32).view(n, 1)
    return k, v


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """Shape of the pools and of the scheduler knobs the harness mirrors.

    `pool_tokens` is small on purpose so sglang's own eviction runs. `tree_core_backend` is
    "rust" (what a CPU server selects by default) or "python".
    """

    page_size: int = 1
    pool_tokens: int = 4096
    max_running_requests: int = 8
    max_context_len: int = 4096
    num_layers: int = 2
    chunked_prefill_size: int | None = 256
    max_prefill_tokens: int = 16384
    new_token_ratio: float = 1.0
    tree_core_backend: str = "rust"


@dataclasses.dataclass
class StepReport:
    """What one `SglangCacheHarness.step` did (for test statistics only)."""

    kind: str  # "prefill", "decode" or "idle"
    admitted: list[Any] = dataclasses.field(default_factory=list)
    finished: list[Any] = dataclasses.field(default_factory=list)
    chunked: Any = None


MatchHook = Callable[["SglangCacheHarness", Any], None]


class SglangCacheHarness:
    """Real sglang 0.5.23 cache classes on CPU, driven like `Scheduler` drives them.

    Callers: tests only. `submit` queues a request, `step` runs one scheduler iteration,
    `abort` aborts a request the way `Scheduler.abort_request` does. The harness never edits
    the tree, the allocator or a request's row itself except through sglang functions, apart
    from writing KV values into the pool (the forward pass stand-in).
    """

    def __init__(self, config: HarnessConfig, model_config: Any) -> None:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

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
        if ps == 1:
            self.allocator: Any = TokenToKVPoolAllocator(
                size=config.pool_tokens,
                dtype=torch.float32,
                device="cpu",
                kvcache=self.kv_pool,
                need_sort=False,
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                size=config.pool_tokens,
                page_size=ps,
                dtype=torch.float32,
                device="cpu",
                kvcache=self.kv_pool,
                need_sort=False,
            )
        params = CacheInitParams(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=ps,
            disable=False,
            tree_components=(ComponentType.FULL,),
            tree_core_backend=config.tree_core_backend,
        )
        self.cache = UnifiedRadixCache(params=params)
        self._schedule_batch_cls = ScheduleBatch
        self._spec_none = SpeculativeAlgorithm.NONE
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.waiting_queue: list[Any] = []
        self.chunked_req: Any = None
        self.last_prefill_batch: Any = None
        self.namespaces: dict[tuple[str | None, str | None], int] = {NAMESPACE_NONE: 1}
        self.match_hook: MatchHook | None = None
        self.pending_violations: list[InvariantViolation] = []
        # Checker bookkeeping: slots whose full K/V was compared against `cold_kv`, keyed to
        # (position, chain hash, token, namespace), and slots written since (`mark_dirty`).
        slots_total = config.pool_tokens + config.page_size
        self.verified_fields = torch.full((slots_total, 4), -1, dtype=torch.int64)
        self.dirty = torch.zeros(slots_total, dtype=torch.bool)
        self.checks_run = 0
        self.stats = {"requests": 0, "prefix_hits": 0, "hit_tokens": 0, "evicted_steps": 0}
        self._hit_rids: set[str] = set()
        self._next_rid = 0

    # ---- requests ---------------------------------------------------------------------------

    def namespace_id(self, extra_key: str | None, cache_salt: str | None) -> int:
        """Stable small id of the (extra_key, cache_salt) namespace, registering new ones."""
        key = (extra_key, cache_salt)
        if key not in self.namespaces:
            self.namespaces[key] = len(self.namespaces) + 1
        return self.namespaces[key]

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
        sp.normalize(None)  # as TokenizerManager does; no stop strings, so no tokenizer use
        req = Req(
            rid=f"h{self._next_rid}",
            origin_input_text="",
            origin_input_ids=array("q", [int(t) for t in token_ids]),
            sampling_params=sp,
            extra_key=extra_key,
            cache_salt=cache_salt,
        )
        req.logprob_start_len = -1
        self._next_rid += 1
        self.namespace_id(extra_key, cache_salt)
        self.waiting_queue.append(req)
        self.stats["requests"] += 1
        return req

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

    def live_requests(self) -> list[Any]:
        """Requests that hold a req_to_token row now (running, chunked, or just prefilled)."""
        seen: dict[int, Any] = {}
        batches = [self.running_batch, self.last_prefill_batch]
        for batch in batches:
            if batch is None:
                continue
            for r in batch.reqs:
                if r.kv.holds_kv:
                    seen[id(r)] = r
        if self.chunked_req is not None and self.chunked_req.kv.holds_kv:
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
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                checkpoint_kv_cache(self.chunked_req, self.cache)
        if self.last_prefill_batch is not None:
            last = self.last_prefill_batch
            self.last_prefill_batch = None
            last.filter_batch(reqs_to_exclude=exclude)
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

    def _num_allocatable_reqs(self) -> int:
        # Scheduler.get_num_allocatable_reqs: free req_to_token rows (running rows are held).
        return self.req_to_token_pool.available_size()

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
            # Continuations are not re-matched (scheduler.py:4177).
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        allocatable = self._num_allocatable_reqs()
        for req in list(self.waiting_queue):
            if adder.budget_state() == AddReqResult.OTHER:
                break
            new_rows = sum(not r.kv.holds_kv for r in adder.can_run_list)
            if new_rows >= allocatable:
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
        if req.prefix_len <= 0:
            return
        if req.rid not in self._hit_rids:  # a waiting request is re-matched every step
            self._hit_rids.add(req.rid)
            self.stats["prefix_hits"] += 1
            self.stats["hit_tokens"] += int(req.prefix_len)
        # Checked now: a matched prefix that is not admitted is unlocked and may be evicted
        # and reused before the step ends.
        try:
            check_exact_match(self, req)
        except InvariantViolation as err:
            self.pending_violations.append(err)

    # ---- forward stand-in -------------------------------------------------------------------

    def mark_dirty(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Tell the checker these pool slots were written (by anything but sglang itself)."""
        idx = torch.as_tensor(slots, dtype=torch.int64)
        self.dirty[idx] = True

    def _ns_of(self, req: Any) -> int:
        return self.namespace_id(req.extra_key, req.cache_salt)

    def _stored_hash(self, slot: int) -> int:
        return int(self.kv_pool.k_buffer[0][slot, 0, _FIELD_HASH].item())

    def _write_kv(self, req: Any, start: int, end: int) -> None:
        """Compute and store KV for positions [start, end) of `req`'s row, reading h_{start-1}."""
        if end <= start:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
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
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        h = self._stored_hash(int(row[position]))
        return 1000 + h % (self.vocab_size - 2000)

    def _forward_extend(self, batch: Any) -> None:
        """Write KV for the positions the batch computes: [prefix_len, extend_end), or, for a
        sparse request (semblend's one-pass extend), its kept positions in ascending order, each
        reading the KV stored at the position before it. Checks that ``out_cache_loc`` holds
        exactly the row's slots at those positions, in batch order."""
        from semblend_sglang.patches.sglang.one_pass import SPARSE_ATTR

        sparse = getattr(batch, SPARSE_ATTR, None) or {}
        expected: list[torch.Tensor] = []
        for req in batch.reqs:
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            positions = sparse.get(req.rid)
            if positions is None:
                positions = torch.arange(req.prefix_len, req.extend_end)
            expected.append(row[positions.to(torch.int64)].to(torch.int64))
            runs = torch.tensor_split(
                positions, (torch.diff(positions) != 1).nonzero().flatten() + 1
            )
            for run in runs:
                if run.numel():
                    self._write_kv(req, int(run[0]), int(run[-1]) + 1)
        got = batch.out_cache_loc.to(torch.int64)
        want = torch.cat(expected) if expected else got
        if not torch.equal(got, want):
            self.pending_violations.append(
                InvariantViolation("out_cache_loc is not the row's slots at the computed positions")
            )

    def _process_prefill_result(self, batch: Any, report: StepReport) -> None:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(self._next_token(req, req.extend_end - 1))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.cache, checkpoint=True)
                report.finished.append(req)
            else:
                checkpoint_kv_cache(req, self.cache)

    def _decode_step(self) -> StepReport:
        from sglang.srt.mem_cache.common import release_kv_cache

        report = StepReport(kind="decode")
        batch = self.running_batch
        if not batch.check_decode_mem():
            self.retract_decode()
            if batch.is_empty():
                return report
        batch.prepare_for_decode()
        for i, req in enumerate(batch.reqs):
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            assert int(row[pos]) == int(batch.out_cache_loc[i]), (req.rid, pos, req.kv)
            ns = self._ns_of(req)
            prev = self._stored_hash(int(row[pos - 1]))
            h = chain_hash(prev, int(req.output_ids[-1]))
            self._store(row[pos : pos + 1].to(torch.int64), [req.output_ids[-1]], [pos], [h], ns)
        for req in batch.reqs:
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            req.output_ids.append(self._next_token(req, pos))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.cache, checkpoint=True)
                report.finished.append(req)
        batch.filter_batch()
        return report


# ---- invariant checker ------------------------------------------------------------------------


def _free_pages(h: SglangCacheHarness) -> torch.Tensor:
    pages = h.allocator.get_all_free_pages()
    return pages.to(torch.int64) if pages is not None else torch.empty(0, dtype=torch.int64)


def _held_slots(h: SglangCacheHarness) -> list[int]:
    """Slots the adapter's held-donor store owns on this cache (empty without one)."""
    from semblend_sglang.patches.sglang.held_donors import HELD_ATTR

    store = getattr(h.cache, HELD_ATTR, None)
    return [] if store is None else store.all_slots().tolist()


def _tree_walk(h: SglangCacheHarness) -> tuple[list[int], list[int], list[int]]:
    walk = h.cache.tree_core.walk_for_kv_canary(False, False)
    return (
        torch.as_tensor(walk.slot_indices, dtype=torch.int64).tolist(),
        torch.as_tensor(walk.positions, dtype=torch.int64).tolist(),
        torch.as_tensor(walk.prev_slot_indices, dtype=torch.int64).tolist(),
    )


def _python_tree_keys(h: SglangCacheHarness) -> dict[int, tuple[int, int]] | None:
    """slot -> (token id from the node key, namespace id of the node key); None for Rust."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    core = h.cache.tree_core
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
        if ns_key not in h.namespaces:
            raise InvariantViolation(f"tree node under unknown namespace {ns_key}")
        ns = h.namespaces[ns_key]
        for slot, tok in zip(value.tolist(), list(node.key.token_ids), strict=False):
            if slot in out:
                raise InvariantViolation(f"slot {slot} owned by two tree nodes")
            out[slot] = (int(tok), ns)
    return out


def _expect_cold(
    h: SglangCacheHarness,
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


def check_invariants(h: SglangCacheHarness, *, full_kv: bool = False) -> None:
    """Raise `InvariantViolation` if the cache state breaks any safety rule.

    Callers: tests, after every harness step. Reads only: it never matches, locks, evicts or
    touches LRU state. Checks:
    1. free + tree-owned + request-owned + held-donor pages == pool pages, pairwise disjoint,
       and, with no live request, available + evictable == pool (SGLang's idle check);
    2. no duplicate in the allocator free list;
    3. no slot owned by two tree nodes;
    4. no slot both free and owned;
    5. every tree slot holds the KV a cold prefill of its token path produces (`_check_tree_kv`:
       chain induction over `walk_for_kv_canary`, then all K/V values for slots that are new
       in the tree, moved, or written since their last full comparison (`mark_dirty`), and
       for every slot when `full_kv` or on every 20th check);
    6. no namespace crossed: a tree path keeps one namespace, and every exact match made since
       the last check (verified by `check_exact_match` when sglang made it) returned slots
       holding cold KV of the request's own tokens in the request's own namespace.
    """
    _raise_pending(h)  # matches happened first: report them first
    ps = h.config.page_size
    num_pages = h.config.pool_tokens // ps
    free = _free_pages(h)
    free_list = free.tolist()
    free_set = set(free_list)
    if len(free_set) != len(free_list):
        raise InvariantViolation(
            f"free list holds duplicates: {len(free_list)} entries, {len(free_set)} distinct"
        )
    if len(free_list) > num_pages:
        raise InvariantViolation(f"free list ({len(free_list)}) exceeds pool ({num_pages})")

    tree_values = h.cache.all_values_flatten().to(torch.int64).tolist()
    tree_slot_set = set(tree_values)
    if len(tree_slot_set) != len(tree_values):
        dup = len(tree_values) - len(tree_slot_set)
        raise InvariantViolation(f"{dup} slots owned by two tree nodes")
    tree_pages = {s // ps for s in tree_values}

    req_pages: set[int] = set()
    for req in h.live_requests():
        row = h.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        lo, hi = int(req.kv.cache_protected_len), int(req.kv.kv_allocated_len)
        tree_part = row[:lo].to(torch.int64).tolist()
        if any(s not in tree_slot_set for s in tree_part):
            raise InvariantViolation(f"{req.rid}: protected prefix slots not owned by the tree")
        owned = {int(s) // ps for s in row[lo:hi].tolist()}
        if owned & req_pages:
            raise InvariantViolation(f"{req.rid}: slots shared with another live request")
        if owned & tree_pages:
            raise InvariantViolation(f"{req.rid}: request-owned slots also owned by the tree")
        req_pages |= owned
    held_list = _held_slots(h)
    held_pages = {s // ps for s in held_list}
    if len(held_pages) != len(held_list):
        raise InvariantViolation("a slot is held twice by the held-donor store")
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
    if not h.live_requests():  # SGLang's idle check: available + evictable == pool
        accounted = int(h.allocator.available_size()) + int(h.cache.evictable_size())
        if accounted != h.config.pool_tokens:
            raise InvariantViolation(
                f"idle: available + evictable = {accounted} != pool {h.config.pool_tokens}"
            )

    h.checks_run += 1
    _check_tree_kv(h, tree_slot_set, full_kv or h.checks_run % 20 == 0)


def _check_tree_kv(h: SglangCacheHarness, tree_slot_set: set[int], full_kv: bool) -> None:
    """Chain check of every tree slot, vectorized, by induction over the parent links.

    For each slot the stored (position, hash, namespace) must equal (its walk position,
    H(parent's stored hash or the namespace seed, its token), its parent's namespace). Since
    roots start from the seed, this proves every stored hash equals the cold chain hash of the
    slot's token path. Tokens and namespaces come from node keys on the Python TreeCore and
    from the stored fields on the Rust one (whose node keys are not readable without the
    test-only inspection build). Full K/V of all layers and heads is then compared with
    `cold_kv` for new, moved or dirty slots, or for all of them when `full_kv`.
    """
    slots_l, positions_l, prevs_l = _tree_walk(h)
    if set(slots_l) != tree_slot_set or len(slots_l) != len(tree_slot_set):
        raise InvariantViolation("tree walk and all_values_flatten disagree on tree slots")
    if not slots_l:
        return
    slots = torch.tensor(slots_l, dtype=torch.int64)
    positions = torch.tensor(positions_l, dtype=torch.int64)
    prevs = torch.tensor(prevs_l, dtype=torch.int64)
    stored = h.kv_pool.k_buffer[0][slots, 0, :4].to(torch.int64)
    tok, spos, shash, sns = stored.unbind(1)
    keys = _python_tree_keys(h)
    if keys is not None:
        key_tok = torch.tensor([keys[x][0] for x in slots_l], dtype=torch.int64)
        key_ns = torch.tensor([keys[x][1] for x in slots_l], dtype=torch.int64)
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
    seed = (sns * 7_919 + 1) % _HASH_MODULUS
    prev_hash = torch.where(has_parent, shash[parent_row], seed)
    prev_ns = torch.where(has_parent, sns[parent_row], sns)
    want_hash = (prev_hash * _HASH_MULTIPLIER + tok + 1) % _HASH_MODULUS
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
    h: SglangCacheHarness,
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


def check_exact_match(h: SglangCacheHarness, req: Any) -> None:
    """Raise `InvariantViolation` unless `req`'s matched prefix holds cold KV of its own tokens.

    Callers: the harness right after `init_next_round_input` set `req.prefix_len`. Reads only.
    """
    n = int(req.prefix_len)
    if n <= 0:
        return
    slots = h.cache.prefix_device_indices(req).to(torch.int64)
    if slots.numel() != n:
        raise InvariantViolation(f"{req.rid}: prefix_len {n} but {slots.numel()} prefix slots")
    tokens = [int(t) for t in req.full_untruncated_fill_ids[:n]]
    ns = h.namespace_id(req.extra_key, req.cache_salt)
    hashes = chain_hashes(namespace_seed(ns), tokens)
    _expect_cold(
        h,
        slots.tolist(),
        tokens,
        list(range(n)),
        hashes,
        [ns] * n,
        f"exact match of {req.rid} (namespace {req.extra_key!r}/{req.cache_salt!r})",
    )


def _raise_pending(h: SglangCacheHarness) -> None:
    pending, h.pending_violations = h.pending_violations, []
    if pending:
        raise pending[0]
