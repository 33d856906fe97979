"""Adapter for legacy sglang (0.5.15 - 0.5.18): hooks on ``RadixCache`` and ``HiRadixCache``.

In these versions the scheduler's KV tree is ``RadixCache`` (``HiRadixCache`` with
``--enable-hierarchical-cache``); requests carry ``prefix_indices`` (the matched slots) and an
``extend_range``, and the tree is written by ``cache_unfinished_req`` (a chunk, or the prompt after
prefill) and ``cache_finished_req`` (release). From 0.5.19 on the default tree is
``UnifiedRadixCache`` even though ``hiradix_cache.py`` still ships (docs/sglang-legacy.md), so this
adapter does not claim those versions.

exact_spans: docs/architecture.md's request path; these versions' hooks: docs/sglang-legacy.md.

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

import logging
import os
from array import array
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from semblend_sglang.config import Config
from semblend_sglang.config_fields import parse_flag
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason

from .. import rank_agreement
from ..flow.request_flow import RequestFlow
from ..flow.substitute import substitute_request
from ..runtime import SemblendRuntime
from ..version_view import TreeMatch, TreeMatchParams
from .adapter import HookTable, SglangAdapter
from .scheduler_hooks import scheduler_wrappers

logger = logging.getLogger(__name__)

_OTHER_TREE_ENV = ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE")
"""sglang env variables that make these versions build a tree this adapter does not hook."""

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


def _lock_node(cache: Any, node: Any) -> Any:
    """Protect ``node``'s path from eviction (legacy trees lock by node; the node is the
    receipt)."""
    cache.inc_lock_ref(node)
    return node


def _unlock_node(cache: Any, node: Any) -> None:
    """Undo :func:`_lock_node`."""
    cache.dec_lock_ref(node)


def _match_len(result: Any) -> int:
    """Tokens a legacy ``MatchResult`` covers: device slots plus the host-resident tail."""
    return len(result.device_indices) + int(getattr(result, "host_hit_length", 0) or 0)


class LegacyRadixCacheAdapter(SglangAdapter):
    """Hooks for sglang 0.5.15 - 0.5.18 (``RadixCache`` / ``HiRadixCache``): a table of wrappers
    that call :class:`~.request_flow.RequestFlow`, and this version's
    :class:`~.version_view.VersionView` (``req.req_pool_idx``, ``req.extend_range.end``,
    ``inc_lock_ref`` / ``dec_lock_ref`` by node, the donor match through the tree)."""

    name = "legacy-radix-cache"
    supported = SpecifierSet(f">={FIRST_VERSION},<{END_VERSION}")

    def __init__(self, config: Config) -> None:
        self.view = LegacyView()
        super().__init__(config, RequestFlow(config, SemblendRuntime(config), self.view))

    # ----------------------------------------------------------------- the hook table
    def hook_table(self) -> HookTable:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        adapter = self
        flow = self.flow
        served = _cache_classes()
        self.view.served = served
        orig_unfinished = RadixCache.cache_unfinished_req
        orig_finished = RadixCache.cache_finished_req
        orig_abort = Scheduler.abort_request

        def make_match_prefix(orig_match: Any) -> Any:
            def match_prefix(self: Any, params: Any) -> Any:
                result = orig_match(self, params)
                req = getattr(params, "req", None)
                key = params.key
                # EAGLE's bigram keys are not a token prefix the flow can plan on
                if req is not None and type(self) in served and not getattr(key, "is_bigram", 0):
                    rid = getattr(req, "rid", None)
                    limit = getattr(key, "limit", None)
                    exact = _match_len(result)
                    flow.guarded(
                        "match_prefix", rid, None, flow.plan, self, req, key.token_ids, limit, exact
                    )
                return result

            return match_prefix

        def cache_unfinished_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> None:
            rid = getattr(req, "rid", None)
            cap = flow.publish_cap(rid) if type(self) in served else None
            if cap is None:
                orig_unfinished(self, req, *args, **kwargs)
                if type(self) in served:
                    end = int(req.extend_range.end)
                    flow.guarded("cache_unfinished_req", rid, None, flow.register_donor, req, end)
                return
            if int(req.cache_protected_len) < cap:
                # T[protected:c) was computed in this chunk before its first copied position
                # (exact): the original publishes T[0:c), seeing a fill that ends at c.
                whole = req.extend_range
                req.extend_range = whole._replace(end=cap)
                try:
                    orig_unfinished(self, req, *args, **kwargs)
                finally:
                    req.extend_range = whole
            flow.guarded("cache_unfinished_req", rid, None, adapter._keep_unpublished, self, req)
            # T[0:c) is in the tree now: the request donates that exact head
            flow.guarded("cache_unfinished_req", rid, None, flow.register_donor, req, cap, cap)

        def cache_finished_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> None:
            if type(self) not in served:
                orig_finished(self, req, *args, **kwargs)
                return
            cap = flow.publish_cap(getattr(req, "rid", None))
            is_insert = kwargs.get("is_insert", args[0] if args else True)
            published = bool(is_insert) and not getattr(self, "disable_finished_insert", False)
            committed = int(kwargs.get("kv_len_to_handle", getattr(req, "kv_committed_len", 0)))
            if cap is not None:
                adapter._drop_unpublished(self, req, cap, kwargs)
                committed = min(committed, cap)
            orig_finished(self, req, *args, **kwargs)
            flow.guarded(
                "release", None, None, adapter._after_finished, req, published, committed, cap
            )

        def abort_request(self: Any, recv_req: Any) -> Any:
            # A waiting request that is aborted never reaches cache_finished_req (0.5.15
            # scheduler.py:3874-3886 only pops it): drop the plans of those that left the queue.
            waiting = list(getattr(self, "waiting_queue", ()))
            out = orig_abort(self, recv_req)
            flow.guarded("abort", None, None, adapter._after_abort, waiting, self.waiting_queue)
            return out

        wrappers: dict[tuple[type, str], Any] = {}
        for cls in served:
            if "match_prefix" in cls.__dict__:
                wrappers[(cls, "match_prefix")] = make_match_prefix(cls.__dict__["match_prefix"])
        wrappers.update(
            {
                (RadixCache, "cache_unfinished_req"): cache_unfinished_req,
                (RadixCache, "cache_finished_req"): cache_finished_req,
                **self.extend_wrappers(ScheduleBatch, ForwardBatch),
                (Scheduler, "abort_request"): abort_request,
                **scheduler_wrappers(flow, Scheduler, Scheduler, adapter._substitute),
            }
        )
        for name in _OTHER_TREE_ENV:
            if parse_flag(os.environ.get(name)):
                logger.warning(
                    "semblend: %s is set, so SGLang builds a tree the legacy adapter does not "
                    "hook; no semantic reuse will happen",
                    name,
                )
        # torch_native only: the split view's triton hooks are tested against 0.5.23's
        # TritonAttnBackend, not these versions', so a triton backend fails
        # sparse_extend_supported here and every plan is declined (unsupported_cache).
        return HookTable(wrappers, triton_attention=False)

    def _after_abort(self, waiting_before: list[Any], waiting_after: list[Any]) -> None:
        """Requests that ``abort_request`` took out of the waiting queue: drop their plans."""
        still = {id(r) for r in waiting_after}
        for req in waiting_before:
            if id(req) not in still:
                self.flow.abort(req.rid)

    # ----------------------------------------------------------------- 3. publish up to the cap
    @staticmethod
    def _keep_unpublished(cache: Any, req: Any) -> None:
        """After ``cache_unfinished_req`` of a request that reused KV (its tree part is T[0:c)
        now): carry the whole row up to the chunk's end as its prefix for the next chunk; the
        lock stays on the c node and ``cache_protected_len`` at c."""
        row = cache.req_to_token_pool.req_to_token[req.req_pool_idx, : int(req.extend_range.end)]
        req.prefix_indices = row.to(dtype=torch.int64, copy=True)

    @staticmethod
    def _drop_unpublished(cache: Any, req: Any, cap: int, kwargs: dict[str, Any]) -> None:
        """Before ``cache_finished_req`` of a request that reused KV: free its own slots from
        the publish cap c on and make the original handle T[0:c) only (inserted now if this
        chunk computed part of it; nothing after c is inserted, nothing is freed twice).

        0.5.15: the original reads ``req.kv_committed_len`` and ``release_kv_cache`` then frees
        [committed, allocated): free [c, allocated) here and set both lengths to c.
        0.5.16 - 0.5.18: ``release_kv_cache`` passes ``kv_len_to_handle`` and frees
        [kv_len_to_handle, allocated) itself afterwards: free [c, kv_len_to_handle) here and
        pass c instead.
        """
        row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        if "kv_len_to_handle" in kwargs:
            end = int(kwargs["kv_len_to_handle"])
            kwargs["kv_len_to_handle"] = min(end, cap)
        else:
            end = max(_allocated_len(req), int(req.kv_committed_len))
            _set_kv_lens(req, cap)
        if end > cap:
            cache.token_to_kv_pool_allocator.free(row[cap:end].to(torch.int64))

    def _after_finished(self, req: Any, register: bool, committed: int, cap: int | None) -> None:
        """After ``cache_finished_req``: a request whose prompt (or, with a publish cap ``cap``,
        exact head) was published becomes a donor; its state is dropped (also when registering
        fails). A plan still open with nothing copied (the request was aborted, or retracted,
        before its last chunk) is declined first: ``aborted``, or ``engine_declined`` for a
        request that did not finish. 0.5.15 calls nothing else on the tree for an aborted
        chunked request (``process_pending_chunked_abort``, scheduler.py:2547)."""
        flow = self.flow
        try:
            state = flow.state_of(req.rid)
            if state is not None and state.open and not state.reused_any:
                reason = Reason.ABORTED if req.finished() else Reason.ENGINE_DECLINED
                flow.decline(req.rid, reason)
            if register:
                flow.register_donor(req, committed, cap)
        finally:
            flow.release(req.rid)

    # ----------------------------------------------------------------- substitute mode
    def _substitute(self, scheduler: Any, req: Any) -> None:
        """Substitute mode at arrival (:func:`.substitute.substitute_request`) on a served tree."""
        cache = getattr(scheduler, "tree_cache", None)
        if not self.view.serves(cache) or cache.disable:
            return
        substitute_request(
            self.flow, scheduler, req, cache, lambda t, ns: self.view.cached_len(cache, t, ns)
        )


class LegacyView:
    """sglang 0.5.15 - 0.5.18's :class:`~.version_view.VersionView` (``req.req_pool_idx``,
    ``req.extend_range.end``, ``inc_lock_ref`` / ``dec_lock_ref`` by node, the donor match
    through the tree). Built by :class:`LegacyRadixCacheAdapter`, which sets :attr:`served`
    when it installs its hooks; only reads."""

    paged = False
    checks_donor_liveness = False

    def __init__(self) -> None:
        self.served: tuple[type, ...] = ()
        """The tree classes the adapter's hooks serve (empty until they are installed)."""

    def row_of(self, req: Any) -> int:
        return int(req.req_pool_idx)

    def extend_end(self, req: Any) -> int:
        return int(req.extend_range.end)

    def lock(self, cache: Any, node: Any) -> Any:
        return _lock_node(cache, node)

    def unlock(self, cache: Any, receipt: Any) -> None:
        _unlock_node(cache, receipt)

    def peers(self, cache: Any) -> list[Any]:
        return rank_agreement.global_attention_peers(cache)

    def serves(self, cache: Any) -> bool:
        """The hook table serves ``cache``: one of the hooked tree classes, without EAGLE's
        bigram keys."""
        return type(cache) in self.served and not getattr(cache, "is_eagle", False)

    def tree_match(self, params: TreeMatchParams) -> TreeMatch:
        """The tree's match of ``tokens[:end]`` with the original ``match_prefix``: its device
        indices, and the host-resident tail behind them (HiCache)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        end = params.end
        key = _radix_key(RadixKey, array("q", params.tokens[:end].tolist()), params.namespace)
        found = self._donor_match(params.cache, MatchPrefixParams(key=key))
        on_device = len(found.device_indices)
        slots = found.device_indices[:end].to(torch.int64)
        return TreeMatch(on_device, _match_len(found) - on_device, slots, found.last_device_node)

    def _donor_match(self, cache: Any, params: Any) -> Any:
        """The original ``match_prefix`` of the donor's tokens (a seam for the host-tier test)."""
        method = type(cache).match_prefix
        return getattr(method, "__wrapped__", method)(cache, params)

    def cached_len(self, cache: Any, tokens: Any, namespace: Namespace) -> int:
        """Tokens of ``tokens`` the exact cache holds (device and host), via the original match."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = _radix_key(RadixKey, array("q", [int(t) for t in tokens]), namespace)
        method = type(cache).match_prefix
        found = getattr(method, "__wrapped__", method)(cache, MatchPrefixParams(key=key))
        return _match_len(found)
