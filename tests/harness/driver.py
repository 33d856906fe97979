"""The scheduler loop every cache harness shares: real sglang classes on CPU, driven like
`Scheduler.get_next_batch_to_run` drives them.

`CacheHarness` builds the real `ReqToTokenPool`, `MHATokenToKVPool` and
`TokenToKVPoolAllocator` (`PagedTokenToKVPoolAllocator` when page_size > 1) on device ``cpu``
and moves real `Req` objects through one scheduler iteration per `step`:

* stash the chunked request of the previous step (the version's checkpoint of an unfinished
  request, when its chunk computed anything past its prefix);
* merge the previous prefill batch into the running batch (`filter_batch`, `merge_batch`);
* admission with the real `PrefillAdder`: `chunked_req.init_next_round_input()` +
  `add_chunked_req`, then per waiting request `init_next_round_input(tree_cache)` (the tree's
  `match_prefix`, checked by `check_exact_match`) and `add_one_req`, which locks
  `req.last_node`;
* `ScheduleBatch.init_new(...).prepare_for_extend()`, i.e. sglang's own `alloc_for_extend`
  (eviction through `evict_from_tree_cache` when the allocator runs short);
* the "forward": deterministic KV (tests/harness/kv_model.py) written for the positions the
  batch computes: [prefix, extend end), or a sparse request's kept positions (semblend's
  one-pass extend), with `out_cache_loc`, `prefill_input_ids_cpu` and `extend_lens` checked
  against them;
* the prefill result: append the next token, `update_finish_state`, then release the finished
  request or checkpoint the unfinished one;
* with no prefill to run, a decode step: `prepare_for_decode` (sglang's `alloc_for_decode`),
  KV for the decoded token, release of finished requests.

What differs between sglang versions (the tree class, request fields, release calls, aborts,
what the checker reads) is the small set of methods a version's subclass implements
(tests/harness/unified.py, tests/harness/legacy.py). The harness never changes what sglang
decides; it only observes. It is test code, not shipped.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from tests.harness.invariants import (
    InvariantViolation,
    TreeWalk,
    check_exact_match,
    check_invariants,
)
from tests.harness.kv_model import (
    FIELD_HASH,
    NAMESPACE_NONE,
    chain_hash,
    chain_hashes,
    cold_kv,
    namespace_seed,
)


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """Shape of the pools and of the scheduler knobs the harness mirrors.

    `pool_tokens` is small on purpose so sglang's own eviction runs. `tree_core_backend` is
    "rust" (what a CPU server selects by default) or "python"; trees with one core ignore it.
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
    """What one `CacheHarness.step` did (for test statistics only)."""

    kind: str  # "prefill", "decode" or "idle"
    admitted: list[Any] = dataclasses.field(default_factory=list)
    finished: list[Any] = dataclasses.field(default_factory=list)
    chunked: Any = None


MatchHook = Callable[[Any, Any], None]
"""Called as ``hook(harness, req)`` right after a waiting request's match (tests' fault seam)."""


class CacheHarness(ABC):
    """Real sglang cache classes on CPU, driven like `Scheduler` drives them.

    Callers: tests only. `submit` queues a request, `step` runs one scheduler iteration,
    `abort` aborts a request the way the version's `Scheduler.abort_request` does. The harness
    never edits the tree, the allocator or a request's row itself except through sglang
    functions, apart from writing KV values into the pool (the forward pass stand-in).
    Subclasses supply the version's tree and the version-specific calls (abstract methods).
    """

    rid_format = "h{}"
    """How request ids are spelled (`str.format` of a running counter)."""

    def __init__(self, config: HarnessConfig, model_config: Any) -> None:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
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
        allocator_cls: Any = TokenToKVPoolAllocator if ps == 1 else PagedTokenToKVPoolAllocator
        paged: dict[str, Any] = {} if ps == 1 else {"page_size": ps}
        self.allocator: Any = allocator_cls(
            size=config.pool_tokens,
            dtype=torch.float32,
            device="cpu",
            kvcache=self.kv_pool,
            need_sort=False,
            **paged,
        )
        self.cache: Any = self._make_cache()
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

    # ---- the version's part -----------------------------------------------------------------

    @abstractmethod
    def _make_cache(self) -> Any:
        """The version's radix tree over `self.req_to_token_pool` and `self.allocator`."""

    @abstractmethod
    def _req_kwargs(self, extra_key: str | None, cache_salt: str | None) -> dict[str, Any]:
        """`Req` constructor arguments of the namespace (and whatever else the version needs)."""

    @abstractmethod
    def abort(self, req: Any) -> None:
        """Abort `req` following the version's `Scheduler.abort_request`."""

    @abstractmethod
    def row_index(self, req: Any) -> int:
        """`req`'s req_to_token row."""

    @abstractmethod
    def holds_row(self, req: Any) -> bool:
        """True while `req` holds a req_to_token row."""

    @abstractmethod
    def prefix_len(self, req: Any) -> int:
        """Length of `req`'s matched (or carried) prefix for the current round."""

    @abstractmethod
    def extend_end(self, req: Any) -> int:
        """End of the positions `req`'s current round computes."""

    @abstractmethod
    def kv_bounds(self, req: Any) -> tuple[int, int]:
        """(cache_protected_len, kv_allocated_len) of a live request's row."""

    @abstractmethod
    def matched_slots(self, req: Any) -> torch.Tensor:
        """Slots of `req`'s matched prefix (raises `InvariantViolation` if inconsistent)."""

    @abstractmethod
    def free_pages(self) -> torch.Tensor:
        """Every page id the allocator holds free (int64, duplicates kept)."""

    @abstractmethod
    def tree_slots(self) -> list[int]:
        """Every device slot the tree owns (duplicates kept)."""

    @abstractmethod
    def tree_walk(self) -> TreeWalk:
        """Every tree slot with its position and parent slot (and tokens/namespaces if read)."""

    @abstractmethod
    def tree_match(
        self, tokens: list[int], extra_key: str | None = None
    ) -> tuple[torch.Tensor, Any]:
        """(device slots, last device node) of the tree's longest match of `tokens` (tests'
        view of the tree: touches LRU state like any match)."""

    @abstractmethod
    def pinned(self, node: Any) -> AbstractContextManager[None]:
        """Context manager: `node`'s path is locked against eviction inside it."""

    @abstractmethod
    def _admission_full(self, adder: Any, allocatable: int) -> bool:
        """True when the version's scheduler admits no further waiting request this step."""

    @abstractmethod
    def _checkpoint(self, req: Any, *, chunked: bool) -> None:
        """Publish an unfinished request's computed KV (the chunked stash when `chunked`)."""

    @abstractmethod
    def _release_finished(self, req: Any) -> None:
        """Release a finished request's row (publishing its KV)."""

    @abstractmethod
    def _decode_short_of_memory(self) -> None:
        """What the version's scheduler does when a decode step finds too little memory."""

    # ---- requests ---------------------------------------------------------------------------

    def namespace_id(self, extra_key: str | None, cache_salt: str | None = None) -> int:
        """Stable small id of the (extra_key, cache_salt) namespace, registering new ones."""
        key = (extra_key, cache_salt)
        if key not in self.namespaces:
            self.namespaces[key] = len(self.namespaces) + 1
        return self.namespaces[key]

    def ns_of(self, req: Any) -> int:
        """Namespace id of `req` as the tree keys it."""
        return self.namespace_id(req.extra_key, getattr(req, "cache_salt", None))

    def submit(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int = 1,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        custom_params: dict[str, Any] | None = None,
    ) -> Any:
        """Queue a real `Req` (greedy) as `Scheduler.handle_generate_request` would; return it.
        ``custom_params``: the request's ``sampling_params.custom_params``."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(
            temperature=0, max_new_tokens=max_new_tokens, custom_params=custom_params
        )
        sp.normalize(None)  # as TokenizerManager does; no stop strings, so no tokenizer use
        req = Req(
            rid=self.rid_format.format(self._next_rid),
            origin_input_text="",
            origin_input_ids=array("q", [int(t) for t in token_ids]),
            sampling_params=sp,
            **self._req_kwargs(extra_key, cache_salt),
        )
        req.logprob_start_len = -1
        self._next_rid += 1
        self.ns_of(req)
        self.waiting_queue.append(req)
        self.stats["requests"] += 1
        return req

    def live_requests(self) -> list[Any]:
        """Requests that hold a req_to_token row now (running, chunked, or just prefilled)."""
        seen: dict[int, Any] = {}
        for batch in (self.running_batch, self.last_prefill_batch):
            if batch is None:
                continue
            for r in batch.reqs:
                if self.holds_row(r):
                    seen[id(r)] = r
        if self.chunked_req is not None and self.holds_row(self.chunked_req):
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
        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.extend_end(self.chunked_req) > self.prefix_len(self.chunked_req):
                self._checkpoint(self.chunked_req, chunked=True)
        if self.last_prefill_batch is not None:
            last = self.last_prefill_batch
            self.last_prefill_batch = None
            last.filter_batch(exclude)
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
            # Continuations are not re-matched.
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        # Scheduler.get_num_allocatable_reqs: free req_to_token rows (running rows are held).
        allocatable = self.req_to_token_pool.available_size()
        for req in list(self.waiting_queue):
            if self._admission_full(adder, allocatable):
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
        n = self.prefix_len(req)
        if n <= 0:
            return
        if req.rid not in self._hit_rids:  # a waiting request is re-matched every step
            self._hit_rids.add(req.rid)
            self.stats["prefix_hits"] += 1
            self.stats["hit_tokens"] += n
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

    def row(self, req: Any) -> torch.Tensor:
        """`req`'s req_to_token row (a view into the pool)."""
        return self.req_to_token_pool.req_to_token[self.row_index(req)]

    def _stored_hash(self, slot: int) -> int:
        return int(self.kv_pool.k_buffer[0][slot, 0, FIELD_HASH].item())

    def _write_kv(self, req: Any, start: int, end: int) -> None:
        """Compute and store KV for positions [start, end) of `req`'s row, reading h_{start-1}."""
        if end <= start:
            return
        row = self.row(req)
        slots = row[start:end].to(torch.int64)
        ns = self.ns_of(req)
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
        h = self._stored_hash(int(self.row(req)[position]))
        return 1000 + h % (self.vocab_size - 2000)

    def _forward_extend(self, batch: Any) -> None:
        """Write KV for the positions the batch computes: [prefix, extend end), or, for a sparse
        request (semblend's one-pass extend), its kept positions in ascending order, each
        reading the KV stored at the position before it. Checks that ``out_cache_loc`` holds
        exactly the row's slots at those positions, in batch order, then the batch's input ids
        and lengths (`_extend_inputs_violation`)."""
        from semblend_sglang.patches.sglang.flow.batch_state import batch_reuse

        reuse = batch_reuse(batch)
        sparse = {} if reuse is None else reuse.sparse
        expected_loc: list[torch.Tensor] = []
        expected_ids: list[torch.Tensor] = []
        for req in batch.reqs:
            row = self.row(req)
            positions = sparse.get(req.rid)
            if positions is None:
                positions = torch.arange(self.prefix_len(req), self.extend_end(req))
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
        if not torch.equal(got, want):
            self.pending_violations.append(
                InvariantViolation("out_cache_loc is not the row's slots at the computed positions")
            )
            return
        want_ids = torch.cat(expected_ids) if expected_ids else torch.empty(0, dtype=torch.int64)
        violation = self._extend_inputs_violation(batch, want_ids)
        if violation is not None:
            self.pending_violations.append(violation)

    @staticmethod
    def _extend_inputs_violation(batch: Any, want_ids: torch.Tensor) -> InvariantViolation | None:
        """The violation, if any, of the extend batch's inputs: ``prefill_input_ids_cpu`` holds
        `want_ids` (the computed positions' tokens) and ``extend_lens`` /
        ``extend_num_tokens`` add up to them."""
        ids = batch.prefill_input_ids_cpu
        if ids is None or not torch.equal(ids.to(torch.int64), want_ids):
            return InvariantViolation("prefill_input_ids_cpu is not the computed positions' tokens")
        n = int(want_ids.numel())
        if int(batch.extend_num_tokens) != n or sum(batch.extend_lens) != n:
            return InvariantViolation("extend_lens / extend_num_tokens disagree with out_cache_loc")
        return None

    def _process_prefill_result(self, batch: Any, report: StepReport) -> None:
        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(self._next_token(req, self.extend_end(req) - 1))
            req.update_finish_state()
            if req.finished():
                self._release_finished(req)
                report.finished.append(req)
            else:
                self._checkpoint(req, chunked=False)

    def _decode_step(self) -> StepReport:
        report = StepReport(kind="decode")
        batch = self.running_batch
        if not batch.check_decode_mem():
            self._decode_short_of_memory()
            if batch.is_empty():
                return report
        batch.prepare_for_decode()
        for i, req in enumerate(batch.reqs):
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            row = self.row(req)
            assert int(row[pos]) == int(batch.out_cache_loc[i]), (req.rid, pos)
            ns = self.ns_of(req)
            prev = self._stored_hash(int(row[pos - 1]))
            h = chain_hash(prev, int(req.output_ids[-1]))
            self._store(row[pos : pos + 1].to(torch.int64), [req.output_ids[-1]], [pos], [h], ns)
        for req in batch.reqs:
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            req.output_ids.append(self._next_token(req, pos))
            req.update_finish_state()
            if req.finished():
                self._release_finished(req)
                report.finished.append(req)
        batch.filter_batch()
        return report
