"""Adapter for sglang >= 0.5.21: hooks on ``UnifiedRadixCache``, ``ScheduleBatch`` and
``ForwardBatch``.

exact_spans, per request T with exact hit m and a plan of spans [a_i, b_i) <- donor_i:

1. ``UnifiedRadixCache.match_prefix``: the original runs and its result is returned unchanged
   (the exact cache stays authoritative); the provider is asked once per request id.
2. The request is admitted like any other. ``ScheduleBatch.prepare_for_extend`` lays its row out
   in position order with fresh slots for [m, n); after it, :mod:`.one_pass` copies every span
   of the chunk from its donor into those slots (K rotated by the span's delta, the whole batch
   in one kernel launch) and drops the copied positions from the batch's computed tokens.
3. ``ForwardBatch.init_new`` gives the computed tokens their true positions; the attention
   backend (:mod:`.attention`) lets the query at position p see every key at position <= p.
4. Every ``checkpoint`` of a request that reused KV is capped at its first copied position:
   nothing reused, nor anything computed after it, reaches the tree; SGLang's release frees
   those slots, which only this request ever owned.
5. A request whose prompt is published becomes a donor (the provider keeps its token ids); one
   that reused KV donates its exact head from the tree and, when it finishes, the rest of its
   prompt KV from a :class:`~.held_donors.HeldDonorStore` on the cache: slots that SGLang would
   free at release, kept outside the tree, counted as evictable and evicted before the tree.

substitute (opt-in, output-changing): ``Scheduler._add_request_to_queue`` rewrites an arriving
request's prompt T to D[:a0] + T[a:] for its plan's first span [a, b) <- donor D [a0, b0), once
the provider's similarity gate passed; SGLang's exact prefix cache then serves D[:b0] unchanged.
No KV is copied and nothing approximate exists. The hooks above stand aside for such requests.

Any failure declines the plan or makes it a cold fallback; the request continues normally.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import replace
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from semblend_sglang.config import Config
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason

from .attention import attention_supported
from .donor_heads import HEADS_ATTR, DonorHeads
from .held_donors import HELD_ATTR, HeldDonorStore, PendingKeep, held_store, held_store_tokens
from .hooked_adapter import HookedAdapter
from .one_pass import DonorSlots
from .request_info import eligible
from .runtime import RequestReuse
from .scheduler_hooks import (
    wrap_add_request_to_queue,
    wrap_get_internal_state,
    wrap_scheduler_init,
)
from .substitute import substitute_request

logger = logging.getLogger(__name__)


class UnifiedRadixCacheAdapter(HookedAdapter):
    """Hooks for sglang 0.5.21+ (``UnifiedRadixCache``; Rust or Python tree core)."""

    name = "unified-radix-cache"
    supported = SpecifierSet(">=0.5.21,<0.6")

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._pending_keep: dict[int, PendingKeep] = {}
        """Finished requests to keep as held donors, by ``id(req.kv)``, from their last
        checkpoint to their row's release (``free_kv_row``)."""

    # ----------------------------------------------------------------- install
    def apply(self) -> None:
        if self._originals:
            return
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.internal_state import (
            SchedulerInternalStateController,
        )
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        adapter = self
        runtime = self.runtime
        held_tokens = held_store_tokens
        orig_match = UnifiedRadixCache.match_prefix
        orig_checkpoint = UnifiedRadixCache.checkpoint
        orig_on_release = UnifiedRadixCache.on_release
        orig_reset = UnifiedRadixCache.reset
        orig_finish = UnifiedRadixCache.finish
        orig_free_kv_row = UnifiedRadixCache.free_kv_row
        orig_evictable = UnifiedRadixCache.evictable_size
        orig_full_evictable = UnifiedRadixCache.full_evictable_size
        orig_evict = UnifiedRadixCache.evict
        orig_evict_for_alloc = UnifiedRadixCache.evict_for_alloc
        orig_free_values = UnifiedRadixCache._free_values
        orig_internal_state = SchedulerInternalStateController.get_internal_state
        orig_add_to_queue = Scheduler._add_request_to_queue
        orig_scheduler_init = Scheduler.__init__

        def match_prefix(self: Any, params: Any) -> Any:
            result = orig_match(self, params)
            req = getattr(params, "req", None)
            if req is not None:
                rid = getattr(req, "rid", None)
                runtime.guarded(
                    "match_prefix", rid, None, adapter._on_match, self, params, req, result
                )
            return result

        def checkpoint(self: Any, req: Any, *, up_to: int, **kwargs: Any) -> None:
            state = runtime.state_of(getattr(req, "rid", None))
            if state is not None and state.reused_any:
                up_to = min(up_to, state.publish_cap)
            orig_checkpoint(self, req, up_to=up_to, **kwargs)
            rid = getattr(req, "rid", None)
            runtime.guarded("checkpoint", rid, None, adapter._after_checkpoint, self, req, up_to)

        def free_kv_row(self: Any, kv: Any, ranges: list[tuple[int, int]]) -> None:
            pending = adapter._pending_keep.pop(id(kv), None)
            kept = None
            if pending is not None and pending.kv is kv:
                kept = runtime.guarded(
                    "keep", None, None, adapter._split_kept, self, pending, ranges
                )
            if kept is None:
                orig_free_kv_row(self, kv, ranges)
                return
            rest, slots, held_from = kept
            if rest:
                orig_free_kv_row(self, kv, rest)
            runtime.guarded("keep", None, None, adapter._keep, self, pending, slots, held_from)

        def on_release(self: Any, req: Any, *, checkpointed: bool) -> None:
            orig_on_release(self, req, checkpointed=checkpointed)
            adapter._pending_keep.pop(id(getattr(req, "kv", None)), None)
            runtime.guarded("release", None, None, runtime.release, req.rid)

        def evictable_size(self: Any) -> int:
            return int(orig_evictable(self)) + held_tokens(self)

        def full_evictable_size(self: Any) -> int:
            return int(orig_full_evictable(self)) + held_tokens(self)

        def evict(self: Any, params: Any) -> Any:
            freed = runtime.guarded("evict", None, 0, adapter._evict_held, self, params.num_tokens)
            if freed:
                params = replace(params, num_tokens=max(0, params.num_tokens - freed))
            result = orig_evict(self, params)
            result.num_tokens_evicted += freed
            runtime.guarded("evict", None, None, adapter._forget_evicted, self)
            return result

        def evict_for_alloc(self: Any, params: Any, **kwargs: Any) -> Any:
            freed = runtime.guarded("evict", None, 0, adapter._evict_held, self, params.num_tokens)
            if freed:
                params = replace(params, num_tokens=max(0, params.num_tokens - freed))
            result = orig_evict_for_alloc(self, params, **kwargs)
            result.num_tokens_evicted += freed
            runtime.guarded("evict", None, None, adapter._forget_evicted, self)
            return result

        def free_values(self: Any, device_frees: Any, host_frees: Any) -> None:
            # before the original: its drain pops each component's list from the dict
            runtime.guarded("evict", None, None, adapter._note_freed, self, device_frees)
            orig_free_values(self, device_frees, host_frees)

        def finish(self: Any, handle: Any, outcome: Any) -> None:
            orig_finish(self, handle, outcome)
            if outcome is not CacheRequestOutcome.SUCCESS:  # aborted: maybe never released
                runtime.guarded("abort", None, None, runtime.abort, handle.rid)

        def reset(self: Any, *args: Any, **kwargs: Any) -> Any:
            runtime.guarded("reset", None, None, adapter._drop_held, self)
            heads = getattr(self, HEADS_ATTR, None)
            if heads is not None:
                heads.clear()
            out = orig_reset(self, *args, **kwargs)
            # /flush_cache and friends: every donor's KV is gone
            runtime.guarded("reset", None, None, runtime.forget_all_donors)
            return out

        replacements = {
            (UnifiedRadixCache, "match_prefix"): match_prefix,
            (UnifiedRadixCache, "checkpoint"): checkpoint,
            (UnifiedRadixCache, "on_release"): on_release,
            (UnifiedRadixCache, "reset"): reset,
            (UnifiedRadixCache, "finish"): finish,
            (UnifiedRadixCache, "free_kv_row"): free_kv_row,
            (UnifiedRadixCache, "evictable_size"): evictable_size,
            (UnifiedRadixCache, "full_evictable_size"): full_evictable_size,
            (UnifiedRadixCache, "evict"): evict,
            (UnifiedRadixCache, "evict_for_alloc"): evict_for_alloc,
            (UnifiedRadixCache, "_free_values"): free_values,
            **self._one_pass_wrappers(ScheduleBatch, ForwardBatch),
            (SchedulerInternalStateController, "get_internal_state"): wrap_get_internal_state(
                orig_internal_state, runtime
            ),
            (Scheduler, "_add_request_to_queue"): wrap_add_request_to_queue(
                orig_add_to_queue, runtime, adapter._substitute
            ),
            (Scheduler, "__init__"): wrap_scheduler_init(orig_scheduler_init, runtime),
        }
        self._install(replacements)
        self._install_attention_hooks(triton=True)

    @classmethod
    def _tree_class(cls) -> type:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        return UnifiedRadixCache

    # ----------------------------------------------------------------- 1. lookup
    def _on_match(self, cache: Any, params: Any, req: Any, result: Any) -> None:
        exact_len = int(result.device_prefix_len) + int(getattr(result, "host_hit_length", 0) or 0)
        key = params.key
        self._plan(cache, req, key.token_ids, getattr(key, "limit", None), exact_len)

    def _cache_supported(self, cache: Any) -> bool:
        return (
            self._pool_supported(cache) and attention_supported() and self.backend_ok is not False
        )

    # ----------------------------------------------------------------- 3. publish
    def _after_checkpoint(self, cache: Any, req: Any, up_to: int) -> None:
        state = self.runtime.state_of(req.rid)
        if state is None or not state.reused_any:
            self._register_donor(req, up_to)
            self._watch_head(cache, req)
            return
        # only its exact head (before the publish cap) is in the tree: a donor of that, and of
        # the rest of its prompt once it finished and its row is released (free_kv_row)
        self._register_donor(req, up_to, cap=state.publish_cap)
        self._watch_head(cache, req)
        if (
            self.config.keep_reused_donors
            and req.finished()
            and len(req.origin_input_ids) >= self.config.min_prompt_tokens
            and eligible(req)
        ):
            self._pending_keep[id(req.kv)] = PendingKeep(
                req.kv, req.rid, state.namespace, list(req.origin_input_ids)
            )

    # ----------------------------------------------------------------- held donors
    def _split_kept(
        self, cache: Any, pending: PendingKeep, ranges: list[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], torch.Tensor, int] | None:
        """The release of a request marked at its last checkpoint frees ``ranges`` of its row:
        (what is still to be freed, the prompt slots to keep, their first position), or None to
        free everything (nothing of the prompt is unpublished, or the row is not the expected
        one)."""
        prompt_len = len(pending.tokens)
        if len(ranges) != 1 or int(cache.page_size) != 1:
            return None
        lo, hi = int(ranges[0][0]), int(ranges[0][1])
        if not lo < prompt_len <= hi:
            return None
        row = cache.req_to_token_pool.req_to_token[pending.kv.req_pool_idx]
        slots = row[lo:prompt_len].to(torch.int64).clone()
        return ([(prompt_len, hi)] if prompt_len < hi else []), slots, lo

    def _keep(self, cache: Any, pending: PendingKeep, slots: torch.Tensor, held_from: int) -> None:
        """Hold ``slots`` (prompt positions from ``held_from`` on, no longer in the request's row)
        as donor KV of ``pending``'s whole prompt. On any failure before the store owns them the
        slots are freed."""
        runtime = self.runtime
        store = held_store(cache)
        try:
            dropped = runtime.register_donor(
                pending.namespace, pending.rid, pending.tokens, extend=True
            )
            handle = runtime.donor_handle(pending.rid)
            if handle is None or not runtime.is_donor(handle):
                cache.token_to_kv_pool_allocator.free(slots)
                return
        except BaseException:
            cache.token_to_kv_pool_allocator.free(slots)
            raise
        store.keep(handle, held_from, slots)
        gone = [h for h in dropped if h in store]
        store.drop_all(gone)
        runtime.held.kept += 1
        runtime.held.dropped += len(gone)
        runtime.held.tokens = store.held_tokens

    def _evict_held(self, cache: Any, num_tokens: int) -> int:
        """Free held donors before SGLang's tree evicts anything: those whose donor the provider
        dropped first, then least recently used ones until ``num_tokens`` slots were freed.
        Returns the slots freed."""
        store: HeldDonorStore | None = getattr(cache, HELD_ATTR, None)
        if store is None or not len(store) or num_tokens <= 0:
            return 0
        runtime = self.runtime
        before = store.held_tokens
        orphans = [h for h in store.handles() if not runtime.is_donor(h)]
        store.drop_all(orphans)
        freed = before - store.held_tokens
        more, gone = store.evict(num_tokens - freed)
        for handle in gone:
            runtime.forget_donor(handle)
        runtime.held.dropped += len(orphans)
        runtime.held.evicted += len(gone)
        runtime.held.tokens = store.held_tokens
        return freed + more

    def _drop_held(self, cache: Any) -> None:
        """The cache is being reset: free every held donor (the provider forgets them next)."""
        store: HeldDonorStore | None = getattr(cache, HELD_ATTR, None)
        if store is not None:
            self.runtime.held.dropped += len(store.clear())
            self.runtime.held.tokens = 0

    def _match_donor(
        self, cache: Any, state: RequestReuse, handle: Any, donor_end: int
    ) -> tuple[str | None, DonorSlots | None]:
        """Where donor ``handle``'s KV for its positions [0, donor_end) is (:class:`DonorSlots`):
        its tokens matched in the tree, and for a held donor its held slots after the tree part.
        (donor_on_host, None) when HiCache holds the rest in host memory (the donor is kept: it
        is used again once SGLang's own load-back, an exact hit on it, brings it to the
        device); (donor_evicted, None) when none of it is left, and the donor is forgotten."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        runtime = self.runtime
        donor = runtime.donor_tokens(handle)
        store: HeldDonorStore | None = getattr(cache, HELD_ATTR, None)
        held = None if store is None else store.get(handle)
        if donor is None or len(donor) < donor_end:
            self._forget(cache, handle)
            return Reason.DONOR_EVICTED, None
        tree_end = donor_end if held is None else min(donor_end, held.held_from)
        ns = state.namespace
        path = torch.empty(0, dtype=torch.int64)
        node = None
        if tree_end > 0:
            key = RadixKey(
                array("q", donor[:tree_end].tolist()),
                extra_key=ns.extra_key,
                cache_salt=ns.cache_salt,
            )
            found = self._donor_match(
                cache, MatchPrefixParams(key=key), self._original_match(cache)
            )
            on_device = min(int(found.device_prefix_len), tree_end)
            if held is None and on_device < donor_end:
                if on_device + int(getattr(found, "host_hit_length", 0) or 0) >= donor_end:
                    return Reason.DONOR_ON_HOST, None
                self._forget(cache, handle)
                return Reason.DONOR_EVICTED, None
            if on_device > 0:
                node = found.last_device_node
                path = cache.tree_core.collect_full_device_indices(
                    node, cache.root_node_handle(ns.extra_key)
                )[:on_device].to(torch.int64)
            if on_device < tree_end:  # a held donor whose head left the tree in part
                path = torch.cat([path, torch.full((tree_end - on_device,), -1, dtype=torch.int64)])
        if held is not None and donor_end > held.held_from:
            path = torch.cat([path, held.slots[: donor_end - held.held_from].cpu()])
            runtime.held.matched += 1
        return None, DonorSlots(path, node)

    def _forget(self, cache: Any, handle: Any) -> None:
        """Donor ``handle``'s KV is gone: forget it, and free what the store held of it."""
        heads: DonorHeads | None = getattr(cache, HEADS_ATTR, None)
        if heads is not None:
            heads.unwatch(handle)
        store: HeldDonorStore | None = getattr(cache, HELD_ATTR, None)
        if store is not None and store.drop(handle):
            self.runtime.held.dropped += 1
            self.runtime.held.tokens = store.held_tokens
        self.runtime.forget_donor(handle)

    # ----------------------------------------------------------------- eviction hook
    def _watch_head(self, cache: Any, req: Any) -> None:
        """Watch the tree slot of a just-registered donor's first token (:mod:`.donor_heads`)."""
        handle = self.runtime.donor_handle(req.rid)
        if handle is None or not self.runtime.is_donor(handle):
            return
        heads: DonorHeads | None = getattr(cache, HEADS_ATTR, None)
        if heads is None:
            heads = DonorHeads(self.config.max_donors, self.runtime.is_donor)
            setattr(cache, HEADS_ATTR, heads)
        if handle not in heads:
            slot = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx][0]
            heads.watch(handle, int(slot))

    def _note_freed(self, cache: Any, device_frees: Any) -> None:
        """SGLang's tree freed ``device_frees`` (slots per component): note watched heads."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        heads: DonorHeads | None = getattr(cache, HEADS_ATTR, None)
        if heads is not None:
            for slots in device_frees.get(ComponentType.FULL, ()):
                heads.freed(slots)

    def _forget_evicted(self, cache: Any) -> None:
        """After an eviction: forget each donor whose head slot it freed (held donors stay).
        With a host tier (HiCache) a freed device slot may be a demotion, so those donors stay
        until a lookup finds their KV gone. No tree match here: a match splits nodes and
        refreshes their LRU order, which would keep what the eviction is freeing."""
        heads: DonorHeads | None = getattr(cache, HEADS_ATTR, None)
        if heads is None:
            return
        freed = heads.take_freed()
        if getattr(cache, "cache_controller", None) is not None:
            return
        store: HeldDonorStore | None = getattr(cache, HELD_ATTR, None)
        for handle in freed:
            if self.runtime.is_donor(handle) and (store is None or handle not in store):
                self._forget(cache, handle)
                self.runtime.evicted_donors += 1

    def _donor_alive(self, cache: Any, namespace: Namespace) -> Any:
        """A held donor keeps its whole prompt (its head's slots are checked at the copy); any
        other donor has the leading tokens the tree still holds, on the device or in host
        memory (SGLang's load-back brings those back)."""
        store: HeldDonorStore | None = getattr(cache, HELD_ATTR, None)

        def alive(handle: Any, tokens: Any) -> int:
            if store is not None and handle in store:
                return len(tokens)
            return self._cached_len(cache, array("q", tokens.tolist()), namespace)

        return alive

    @staticmethod
    def _donor_match(cache: Any, params: Any, orig_match: Any) -> Any:
        """The original ``match_prefix`` of the donor's tokens (a seam for the host-tier test)."""
        return orig_match(cache, params)

    # ----------------------------------------------------------------- substitute mode
    def _substitute(self, scheduler: Any, req: Any) -> None:
        """Substitute mode at arrival (:func:`.substitute.substitute_request`) on a
        ``UnifiedRadixCache``."""
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        cache = getattr(scheduler, "tree_cache", None)
        if not isinstance(cache, UnifiedRadixCache) or cache.disable:
            return
        substitute_request(
            self.runtime, scheduler, req, cache, lambda t, ns: self._cached_len(cache, t, ns)
        )

    @staticmethod
    def _cached_len(cache: Any, tokens: Any, namespace: Namespace) -> int:
        """Tokens of ``tokens`` the exact cache holds (device and host), via the original match."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(tokens, extra_key=namespace.extra_key, cache_salt=namespace.cache_salt)
        match = UnifiedRadixCacheAdapter._original_match(cache)
        found = match(cache, MatchPrefixParams(key=key))
        return int(found.device_prefix_len) + int(getattr(found, "host_hit_length", 0) or 0)

    @staticmethod
    def _original_match(cache: Any) -> Any:
        method = type(cache).match_prefix
        return getattr(method, "__wrapped__", method)
