"""Adapter for legacy sglang (0.5.15 - 0.5.18): hooks on ``RadixCache`` and ``HiRadixCache``.

In these versions the scheduler's KV tree is ``RadixCache`` (``HiRadixCache`` with
``--enable-hierarchical-cache``); requests carry ``prefix_indices`` (the matched slots) and an
``extend_range``, and the tree is written by ``cache_unfinished_req`` (a chunk, or the prompt after
prefill) and ``cache_finished_req`` (release). From 0.5.19 on the default tree is
``UnifiedRadixCache`` even though ``hiradix_cache.py`` still ships (docs/sglang-legacy.md), so this
adapter does not claim those versions.

exact_spans, per request T with exact hit m and plan [a', b') <- donor [a0', b0'), as in the
0.5.21+ adapter (:mod:`.unified`):

1. ``RadixCache.match_prefix`` / ``HiRadixCache.match_prefix``: the original runs and its result is
   returned unchanged; the provider is asked once per request id.
2. ``PrefillAdder.add_one_req`` / ``add_chunked_req``: the prefill chunk that would cross a' is cut
   at a' (the request becomes the scheduler's chunked request), so it first computes T[m:a').
3. ``cache_unfinished_req`` of the chunk ending at a' (the scheduler stashing it): T[0:a') is
   published by the original; then the donor's path is re-matched and locked, the request gets new
   slots of its own for [a', b'), the fused kernel copies the donor's K (rotated by a' - a0') and
   V into them, and ``req.prefix_indices`` grows to b'. The scheduler computes T[b':n].
4. Every later ``cache_unfinished_req`` of that request inserts nothing (its tree part stays
   T[0:a')), and ``cache_finished_req`` first frees the request's own slots [a', end) and then lets
   the original publish only T[0:a'): reused KV, and everything computed after it, never reaches
   the tree, and no slot is owned twice.
5. A request whose prompt is published becomes a donor (the provider keeps its token ids).

substitute (opt-in): ``Scheduler._add_request_to_queue`` rewrites an arriving request's prompt to
``D[:a0] + T[a:]`` exactly as in :mod:`.unified`; the hooks above stand aside for such requests.

Only the exact classes ``RadixCache`` and ``HiRadixCache`` are served; their subclasses (SWA,
Mamba, LMCache) pass through the hooks untouched, and other trees (``RadixCacheCpp``, a
``UnifiedRadixCache`` forced by env) are not hooked. 0.5.15 - 0.5.17 key the tree by ``extra_key``
alone (cache_salt folded in by the OpenAI layer), 0.5.18 by ``extra_key`` and ``cache_salt``;
0.5.16+ keep ``kv_allocated_len`` in ``req.kv`` and pass ``kv_len_to_handle`` to
``cache_finished_req``: the helpers below read either form. Any failure declines the plan or
makes it a cold fallback; the request continues normally.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from array import array
from typing import Any

import torch

from semblend_sglang.config import Config
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason

from .hooked_adapter import HookedAdapter, copy_span_kv
from .runtime import RequestReuse, ReuseState
from .scheduler_hooks import (
    wrap_add_chunked_req,
    wrap_add_request_to_queue,
    wrap_get_internal_state,
)
from .substitute import substitute_request

logger = logging.getLogger(__name__)

_OTHER_TREE_ENV = ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE")
"""sglang env variables that make these versions build a tree this adapter does not hook."""
_CUT_ATTR = "_semblend_cut_at_boundary"

FIRST_VERSION = "0.5.15"
"""Oldest sglang this adapter serves (tests/legacy verified 0.5.15, 0.5.16, 0.5.17, 0.5.18)."""
END_VERSION = "0.5.19"
"""First sglang it does not serve: 0.5.19 builds ``UnifiedRadixCache`` by default."""


def _cache_classes() -> tuple[type, ...]:
    """The tree classes this adapter serves: ``RadixCache`` and (if importable) ``HiRadixCache``."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    try:
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    except Exception:  # its controller imports need a CUDA build on some platforms
        return (RadixCache,)
    return (RadixCache, HiRadixCache)


def _radix_key(radix_key_cls: Any, tokens: array, ns: Namespace) -> Any:
    """``RadixKey`` of ``tokens`` in namespace ``ns``. 0.5.15's key has ``extra_key`` only (the
    OpenAI layer folds cache_salt into it); 0.5.18's also has ``cache_salt``."""
    if "cache_salt" in getattr(radix_key_cls, "__slots__", ()):
        return radix_key_cls(tokens, extra_key=ns.extra_key, cache_salt=ns.cache_salt)
    return radix_key_cls(tokens, extra_key=ns.extra_key)


def _allocated_len(req: Any) -> int:
    """KV slots the request's row holds: ``req.kv_allocated_len`` (0.5.15) or
    ``req.kv.kv_allocated_len`` (0.5.16+)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "kv_allocated_len"):
        return int(kv.kv_allocated_len)
    return int(req.kv_allocated_len)


def _set_kv_lens(req: Any, n: int) -> None:
    """Set the request's committed and allocated KV lengths to ``n`` (either layout)."""
    req.kv_committed_len = n
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "kv_allocated_len"):
        kv.kv_allocated_len = n
    else:
        req.kv_allocated_len = n


def _match_len(result: Any) -> int:
    """Tokens a legacy ``MatchResult`` covers: device slots plus the host-resident tail."""
    return len(result.device_indices) + int(getattr(result, "host_hit_length", 0) or 0)


class LegacyRadixCacheAdapter(HookedAdapter):
    """Hooks for sglang 0.5.15 - 0.5.18 (``RadixCache`` / ``HiRadixCache``)."""

    name = "legacy-radix-cache"

    def __init__(self, config: Config) -> None:
        # One span from one donor: 0.5.15's batch preparation is served by the two-phase
        # chunk cut (docs/sglang-legacy.md says why it has no one-pass form here).
        super().__init__(dataclasses.replace(config, strict_prefix_boundary=True))
        self._served: tuple[type, ...] = ()

    @classmethod
    def supports(cls, version: Any) -> bool:
        from packaging.version import Version

        return bool(Version(FIRST_VERSION) <= version < Version(END_VERSION))

    # ----------------------------------------------------------------- install
    def apply(self) -> None:
        if self._originals:
            return
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.mem_cache.radix_cache import RadixCache

        adapter = self
        runtime = self.runtime
        served = _cache_classes()
        self._served = served
        orig_unfinished = RadixCache.cache_unfinished_req
        orig_finished = RadixCache.cache_finished_req
        orig_add_one = PrefillAdder.add_one_req
        orig_add_chunked = PrefillAdder.add_chunked_req
        orig_internal_state = Scheduler.get_internal_state
        orig_add_to_queue = Scheduler._add_request_to_queue
        orig_abort = Scheduler.abort_request

        def make_match_prefix(orig_match: Any) -> Any:
            def match_prefix(self: Any, params: Any) -> Any:
                result = orig_match(self, params)
                req = getattr(params, "req", None)
                if req is not None and type(self) in served:
                    rid = getattr(req, "rid", None)
                    runtime.guarded(
                        "match_prefix", rid, None, adapter._on_match, self, params, req, result
                    )
                return result

            return match_prefix

        def cache_unfinished_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> None:
            rid = getattr(req, "rid", None)
            state = runtime.state_of(rid)
            if (
                state is not None
                and state.state is ReuseState.MATERIALIZED
                and type(self) in served
            ):
                adapter._keep_unpublished(self, req)
                return
            orig_unfinished(self, req, *args, **kwargs)
            if type(self) in served:
                runtime.guarded(
                    "cache_unfinished_req", rid, None, adapter._after_unfinished, self, req
                )

        def cache_finished_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> None:
            if type(self) not in served:
                orig_finished(self, req, *args, **kwargs)
                return
            rid = getattr(req, "rid", None)
            state = runtime.state_of(rid)
            materialized = state is not None and state.state is ReuseState.MATERIALIZED
            is_insert = kwargs.get("is_insert", args[0] if args else True)
            published = bool(is_insert) and not getattr(self, "disable_finished_insert", False)
            committed = int(kwargs.get("kv_len_to_handle", getattr(req, "kv_committed_len", 0)))
            if materialized:
                adapter._drop_unpublished(self, req, state, kwargs)
            orig_finished(self, req, *args, **kwargs)
            register = published and not materialized
            runtime.guarded(
                "release", None, None, adapter._after_finished, req, register, committed
            )

        def add_one_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, _CUT_ATTR, False):
                # A chunk was cut short at a reuse boundary in this step: admit nothing more,
                # as SGLang does after a chunked request (it tracks one chunked request).
                return AddReqResult.OTHER
            result = orig_add_one(self, req, *args, **kwargs)
            has_chunked = bool(kwargs.get("has_chunked_req", args[0] if args else False))
            return runtime.guarded(
                "admission",
                getattr(req, "rid", None),
                result,
                adapter._cut_admission,
                self,
                req,
                result,
                has_chunked,
                AddReqResult,
            )

        def abort_request(self: Any, recv_req: Any) -> Any:
            # A waiting request that is aborted never reaches cache_finished_req (0.5.15
            # scheduler.py:3874-3886 only pops it): drop the plans of those that left the queue.
            waiting = list(getattr(self, "waiting_queue", ()))
            out = orig_abort(self, recv_req)
            runtime.guarded("abort", None, None, adapter._after_abort, waiting, self.waiting_queue)
            return out

        replacements: dict[tuple[type, str], Any] = {}
        for cls in served:
            if "match_prefix" in cls.__dict__:
                replacements[(cls, "match_prefix")] = make_match_prefix(
                    cls.__dict__["match_prefix"]
                )
        replacements.update(
            {
                (RadixCache, "cache_unfinished_req"): cache_unfinished_req,
                (RadixCache, "cache_finished_req"): cache_finished_req,
                (PrefillAdder, "add_one_req"): add_one_req,
                (PrefillAdder, "add_chunked_req"): wrap_add_chunked_req(
                    orig_add_chunked, runtime, adapter._cut_continuation
                ),
                (Scheduler, "abort_request"): abort_request,
                (Scheduler, "get_internal_state"): wrap_get_internal_state(
                    orig_internal_state, runtime
                ),
                (Scheduler, "_add_request_to_queue"): wrap_add_request_to_queue(
                    orig_add_to_queue, runtime, adapter._substitute
                ),
            }
        )
        self._install(replacements)
        for name in _OTHER_TREE_ENV:
            if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
                logger.warning(
                    "semblend: %s is set, so SGLang builds a tree the legacy adapter does not "
                    "hook; no semantic reuse will happen",
                    name,
                )

    @classmethod
    def _tree_class(cls) -> type:
        from sglang.srt.mem_cache.radix_cache import RadixCache

        return RadixCache

    # ----------------------------------------------------------------- 1. lookup
    def _on_match(self, cache: Any, params: Any, req: Any, result: Any) -> None:
        key = params.key
        if getattr(key, "is_bigram", False):
            return  # EAGLE's bigram keys: not a token prefix this adapter can plan on
        self._plan(cache, req, key.token_ids, getattr(key, "limit", None), _match_len(result))

    def _cache_supported(self, cache: Any) -> bool:
        return (
            type(cache) in self._served
            and not getattr(cache, "is_eagle", False)
            and self._pool_supported(cache)
        )

    # ----------------------------------------------------------------- 2. chunk at a'
    def _cut_admission(
        self, adder: Any, req: Any, result: Any, has_chunked: bool, add_req_result: Any
    ) -> Any:
        state = self.runtime.state_of(req.rid)
        if state is None or state.state is not ReuseState.PLANNED:
            return result
        if not adder.can_run_list or adder.can_run_list[-1] is not req:
            return result  # not admitted in this step; matched again in the next
        start = len(req.prefix_indices)
        end = int(req.extend_range.end)
        if state.boundary <= start:
            self.runtime.decline(req.rid, Reason.SPANS_TRIMMED_AWAY)
            return result
        if state.boundary >= end:
            if adder.new_chunked_req is req:
                state.cut_at_head()  # the cut happens in a later chunk
            return result
        if has_chunked or (adder.new_chunked_req is not None and adder.new_chunked_req is not req):
            self.runtime.decline(req.rid, Reason.CHUNK_SLOT_BUSY)
            return result
        req.set_extend_range(start, state.boundary)
        adder.new_chunked_req = req
        state.cut_at_head()
        setattr(adder, _CUT_ATTR, True)
        return add_req_result.OTHER

    def _cut_continuation(self, adder: Any, req: Any, out: Any) -> Any:
        state = self.runtime.state_of(req.rid)
        if state is None or state.state is not ReuseState.HEAD:
            return out
        start = len(req.prefix_indices)
        if start < state.boundary < int(req.extend_range.end):
            req.set_extend_range(start, state.boundary)
            setattr(adder, _CUT_ATTR, True)
            return req
        return out

    # ----------------------------------------------------------------- 3. materialize
    def _after_unfinished(self, cache: Any, req: Any) -> None:
        runtime = self.runtime
        state = runtime.state_of(req.rid)
        end = int(req.extend_range.end)
        if state is not None and state.state is ReuseState.HEAD and end == state.boundary:
            if (
                req.finished()
                or len(req.prefix_indices) != state.boundary
                or int(req.cache_protected_len) != state.boundary
            ):
                runtime.decline(req.rid, Reason.ENGINE_DECLINED)
                return
            self._materialize(cache, req, state)
            return
        if state is not None and state.state is ReuseState.MATERIALIZED:
            return
        self._register_donor(req, end)

    def _after_abort(self, waiting_before: list[Any], waiting_after: list[Any]) -> None:
        """Requests that ``abort_request`` took out of the waiting queue: drop their plans."""
        still = {id(r) for r in waiting_after}
        for req in waiting_before:
            if id(req) not in still:
                self.runtime.abort(req.rid)

    def _after_finished(self, req: Any, register: bool, committed: int) -> None:
        """After ``cache_finished_req``: a request whose prompt was published becomes a donor;
        its state is dropped (also when registering fails)."""
        try:
            if register:
                self._register_donor(req, committed)
        finally:
            self.runtime.release(req.rid)

    def _materialize(self, cache: Any, req: Any, state: RequestReuse) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        runtime = self.runtime
        rid = req.rid
        plan = state.plan
        donor = runtime.donor_tokens(plan.donor_handle)
        donor_end = state.donor_start + state.reused_tokens
        if donor is None or len(donor) < donor_end:
            runtime.forget_donor(plan.donor_handle)
            runtime.decline(rid, Reason.DONOR_EVICTED)
            return
        ns = state.namespace
        key = _radix_key(RadixKey, array("q", donor[:donor_end].tolist()), ns)
        found = self._donor_match(cache, MatchPrefixParams(key=key))
        on_device = len(found.device_indices)
        if on_device < donor_end:
            if _match_len(found) >= donor_end:
                # HiCache holds the rest in host memory: keep the donor; it is used again once
                # SGLang's own load-back (an exact hit on it) brings it to the device.
                runtime.decline(rid, Reason.DONOR_ON_HOST)
                return
            runtime.forget_donor(plan.donor_handle)
            runtime.decline(rid, Reason.DONOR_EVICTED)
            return
        spec = self.rope_spec()
        if spec is None:
            runtime.decline(rid, Reason.UNSUPPORTED_CACHE)
            return
        node = found.last_device_node
        cache.inc_lock_ref(node)
        try:
            src = found.device_indices[state.donor_start : donor_end].to(torch.int64)
            dst = copy_span_kv(cache, src, state, req.req_pool_idx, spec)
        finally:
            cache.dec_lock_ref(node)
        if dst is None:
            runtime.decline(rid, Reason.NO_CAPACITY)
            return
        prefix = req.prefix_indices
        req.prefix_indices = torch.cat([prefix, dst.to(device=prefix.device, dtype=prefix.dtype)])
        _set_kv_lens(req, state.end)
        req.set_extend_range(state.boundary, state.end)
        state.loaded([(state.span, plan.donor_handle)], state.end)
        runtime.finish_reuse(rid)

    def _donor_match(self, cache: Any, params: Any) -> Any:
        """The original ``match_prefix`` of the donor's tokens (a seam for the host-tier test)."""
        method = type(cache).match_prefix
        return getattr(method, "__wrapped__", method)(cache, params)

    # ----------------------------------------------------------------- 4. never publish a' on
    @staticmethod
    def _keep_unpublished(cache: Any, req: Any) -> None:
        """``cache_unfinished_req`` of a materialized request: insert nothing, keep the lock on
        the a' node, and carry the whole row as the request's prefix for its next chunk."""
        row = cache.req_to_token_pool.req_to_token[req.req_pool_idx, : int(req.extend_range.end)]
        req.prefix_indices = row.to(dtype=torch.int64, copy=True)

    @staticmethod
    def _drop_unpublished(
        cache: Any, req: Any, state: RequestReuse, kwargs: dict[str, Any]
    ) -> None:
        """Before ``cache_finished_req`` of a materialized request: free its own slots from a'
        on and make the original handle T[0:a') only (already in the tree: nothing new is
        inserted, nothing is freed twice).

        0.5.15: the original reads ``req.kv_committed_len`` and ``release_kv_cache`` then frees
        [committed, allocated): free [a', allocated) here and set both lengths to a'.
        0.5.16 - 0.5.18: ``release_kv_cache`` passes ``kv_len_to_handle`` and frees
        [kv_len_to_handle, allocated) itself afterwards: free [a', kv_len_to_handle) here and
        pass a' instead.
        """
        row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        if "kv_len_to_handle" in kwargs:
            end = int(kwargs["kv_len_to_handle"])
            kwargs["kv_len_to_handle"] = min(end, state.boundary)
        else:
            end = max(_allocated_len(req), int(req.kv_committed_len))
            _set_kv_lens(req, state.boundary)
        if end > state.boundary:
            cache.token_to_kv_pool_allocator.free(row[state.boundary : end].to(torch.int64))

    # ----------------------------------------------------------------- substitute mode
    def _substitute(self, scheduler: Any, req: Any) -> None:
        """Substitute mode at arrival (:func:`.substitute.substitute_request`) on a served tree."""
        cache = getattr(scheduler, "tree_cache", None)
        if type(cache) not in self._served or cache.disable or getattr(cache, "is_eagle", False):
            return
        substitute_request(
            self.runtime, scheduler, req, cache, lambda t, ns: self._cached_len(cache, t, ns)
        )

    def _cached_len(self, cache: Any, tokens: Any, namespace: Namespace) -> int:
        """Tokens of ``tokens`` the exact cache holds (device and host), via the original match."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = _radix_key(RadixKey, array("q", [int(t) for t in tokens]), namespace)
        method = type(cache).match_prefix
        found = getattr(method, "__wrapped__", method)(cache, MatchPrefixParams(key=key))
        return _match_len(found)
