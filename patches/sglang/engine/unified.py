"""Adapter for sglang >= 0.5.22: hooks on ``UnifiedRadixCache``, ``ScheduleBatch`` and
``ForwardBatch``.

exact_spans: the request path told in docs/architecture.md ("One request through SGLang 0.5.22+").

substitute (opt-in, output-changing): ``Scheduler._add_request_to_queue`` rewrites an arriving
request's prompt T to D[:a0] + T[a:] for its plan's first span [a, b) <- donor D [a0, b0), once
the provider's similarity gate passed; SGLang's exact prefix cache then serves D[:b0] unchanged.
No KV is copied and nothing approximate exists. The hooks above stand aside for such requests.

Any failure declines the plan or makes it a cold fallback; the request continues normally.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from semblend_sglang.config import Config
from semblend_sglang.namespace import Namespace

from .. import rank_agreement
from ..attention.hook_kit import graph_can_carry
from ..flow import batch_state
from ..flow.passage_order import reorder_request, request_level_key_wrappers
from ..flow.request_flow import RequestFlow
from ..flow.substitute import substitute_request
from ..runtime import SemblendRuntime
from ..version_view import TreeMatch, TreeMatchParams
from ..wrapping import Wrappers
from .adapter import HookTable, SglangAdapter
from .admission import admission_charge, admission_credit
from .scheduler_hooks import scheduler_wrappers

logger = logging.getLogger(__name__)


class UnifiedRadixCacheAdapter(SglangAdapter):
    """Hooks for sglang 0.5.22+ (``UnifiedRadixCache``; Rust or Python tree core): a table of
    wrappers that call :class:`~.request_flow.RequestFlow`, which reads this version through
    :class:`UnifiedView`."""

    name = "unified-radix-cache"
    # Not 0.5.21: its UnifiedRadixCache has no ``checkpoint()`` (a finished request is inserted by
    # ``insert_req``, a chunked one by ``cache_unfinished_req``, which publish without the cap of
    # step 4) and no ``SchedulerInternalStateController``; the version matrix ran it and the
    # patch failed to install (docs/sglang.md, "Version matrix"). Refused at start-up by name.
    supported = SpecifierSet(">=0.5.22,<0.6")

    def __init__(self, config: Config) -> None:
        super().__init__(config, RequestFlow(config, SemblendRuntime(config), UnifiedView()))

    # ----------------------------------------------------------------- the hook table
    def hook_table(self) -> HookTable:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import PrefillAdder
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components import dp_attn
        from sglang.srt.managers.scheduler_components.internal_state import (
            SchedulerInternalStateController,
        )
        from sglang.srt.managers.scheduler_components.output_streamer import (
            SchedulerOutputStreamer,
        )
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
            PrefillCudaGraphRunner,
        )

        flow = self.flow
        donors = flow.donors
        tree = UnifiedRadixCache
        orig_match = tree.match_prefix
        orig_checkpoint = tree.checkpoint
        orig_on_release = tree.on_release
        orig_reset = tree.reset
        orig_finish = tree.finish
        orig_free_kv_row = tree.free_kv_row
        orig_evictable = tree.evictable_size
        orig_full_evictable = tree.full_evictable_size
        orig_evict = tree.evict
        orig_evict_for_alloc = tree.evict_for_alloc
        orig_free_values = tree._free_values

        def match_prefix(self: Any, params: Any) -> Any:
            result = orig_match(self, params)
            req = getattr(params, "req", None)
            if req is not None:
                exact = int(result.device_prefix_len) + _host_len(result)
                key = params.key
                limit = getattr(key, "limit", None)
                rid = getattr(req, "rid", None)
                flow.guarded(
                    "match_prefix", rid, None, flow.plan, self, req, key.token_ids, limit, exact
                )
            return result

        def checkpoint(self: Any, req: Any, *, up_to: int, **kwargs: Any) -> None:
            rid = getattr(req, "rid", None)
            up_to = flow.publish_limit(rid, up_to)
            orig_checkpoint(self, req, up_to=up_to, **kwargs)
            page = int(self.page_size)
            flow.guarded("checkpoint", rid, None, flow.published, req, up_to, page)
            flow.guarded("checkpoint", rid, None, donors.watch_head, self, req)

        def free_kv_row(self: Any, kv: Any, ranges: list[tuple[int, int]]) -> None:
            pending = donors.take_pending(kv)
            kept = None
            if pending is not None:
                kept = flow.guarded("keep", None, None, donors.split_release, self, pending, ranges)
            if kept is None:
                orig_free_kv_row(self, kv, ranges)
                return
            rest, slots, held_from = kept
            if rest:
                orig_free_kv_row(self, kv, rest)
            flow.guarded("keep", None, None, donors.keep, self, pending, slots, held_from)

        def on_release(self: Any, req: Any, *, checkpointed: bool) -> None:
            orig_on_release(self, req, checkpointed=checkpointed)
            donors.take_pending(getattr(req, "kv", None))
            flow.guarded("release", None, None, flow.release, req.rid)

        def evictable_size(self: Any) -> int:
            return int(orig_evictable(self)) + donors.held_tokens(self)

        def full_evictable_size(self: Any) -> int:
            return int(orig_full_evictable(self)) + donors.held_tokens(self)

        def make_evict(orig: Any) -> Any:
            def evict(self: Any, params: Any, **kwargs: Any) -> Any:
                freed = flow.guarded("evict", None, 0, donors.evict, self, params.num_tokens)
                if freed:
                    params = replace(params, num_tokens=max(0, params.num_tokens - freed))
                result = orig(self, params, **kwargs)
                result.num_tokens_evicted += freed
                flow.guarded("evict", None, None, donors.forget_evicted, self)
                return result

            return evict

        def make_admit(orig: Any) -> Any:
            def admit(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
                credit = admission_credit(flow, self.tree_cache, req, self.rem_chunk_tokens)
                if credit.tokens:
                    self.rem_chunk_tokens += credit.tokens
                    self.rem_input_tokens += credit.tokens
                try:
                    return orig(self, req, *args, **kwargs)
                finally:
                    if credit.tokens:
                        admitted = any(r is req for r in self.can_run_list)
                        unused = admission_charge(flow, credit, admitted)
                        self.rem_chunk_tokens -= unused
                        self.rem_input_tokens -= unused

            return admit

        def free_values(self: Any, device_frees: Any, host_frees: Any) -> None:
            # before the original: its drain pops each component's list from the dict
            flow.guarded("evict", None, None, donors.freed, self, device_frees, ComponentType.FULL)
            orig_free_values(self, device_frees, host_frees)

        def finish(self: Any, handle: Any, outcome: Any) -> None:
            orig_finish(self, handle, outcome)
            if outcome is not CacheRequestOutcome.SUCCESS:  # aborted: maybe never released
                flow.guarded("abort", None, None, flow.abort, handle.rid)

        def reset(self: Any, *args: Any, **kwargs: Any) -> Any:
            flow.guarded("reset", None, None, donors.clear, self)
            out = orig_reset(self, *args, **kwargs)
            # /flush_cache and friends: every donor's KV is gone
            flow.guarded("reset", None, None, donors.forget_all)
            return out

        wrappers: Wrappers = {
            (tree, "match_prefix"): match_prefix,
            (tree, "checkpoint"): checkpoint,
            (tree, "on_release"): on_release,
            (tree, "reset"): reset,
            (tree, "finish"): finish,
            (tree, "free_kv_row"): free_kv_row,
            (tree, "evictable_size"): evictable_size,
            (tree, "full_evictable_size"): full_evictable_size,
            (tree, "evict"): make_evict(orig_evict),
            (tree, "evict_for_alloc"): make_evict(orig_evict_for_alloc),
            (tree, "_free_values"): free_values,
            (PrefillAdder, "add_one_req"): make_admit(PrefillAdder.add_one_req),
            (PrefillAdder, "add_chunked_req"): make_admit(PrefillAdder.add_chunked_req),
            **self.extend_wrappers(ScheduleBatch, ForwardBatch),
            **prefill_graph_wrappers(PrefillCudaGraphRunner, dp_attn),
            **scheduler_wrappers(
                flow,
                Scheduler,
                SchedulerInternalStateController,
                self._substitute,
                self._reorder,
            ),
            **request_level_key_wrappers(SchedulerOutputStreamer),
        }
        return HookTable(wrappers, triton_attention=True)

    # ----------------------------------------------------------------- passage order
    def _reorder(self, scheduler: Any, req: Any) -> None:
        """A request's declared passages put in order at arrival
        (:func:`.passage_order.reorder_request`) on a ``UnifiedRadixCache``."""
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        cache = getattr(scheduler, "tree_cache", None)
        if not isinstance(cache, UnifiedRadixCache) or cache.disable:
            return
        reorder_request(
            self.flow, req, lambda t, ns: _cached_len(cache, t, ns), int(cache.page_size)
        )

    # ----------------------------------------------------------------- substitute mode
    def _substitute(self, scheduler: Any, req: Any) -> None:
        """Substitute mode at arrival (:func:`.substitute.substitute_request`) on a
        ``UnifiedRadixCache``."""
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        cache = getattr(scheduler, "tree_cache", None)
        if not isinstance(cache, UnifiedRadixCache) or cache.disable:
            return
        substitute_request(
            self.flow, scheduler, req, cache, lambda t, ns: _cached_len(cache, t, ns)
        )


class UnifiedView:
    """sglang 0.5.22+'s :class:`~.version_view.VersionView` (``req.kv.req_pool_idx``,
    ``req.extend_end``, the tree's ``lock`` / ``unlock`` receipts, ``tree_core`` read for a
    match's slots). Built by :class:`UnifiedRadixCacheAdapter`; only reads."""

    paged = True
    checks_donor_liveness = True

    def row_of(self, req: Any) -> int:
        return int(req.kv.req_pool_idx)

    def extend_end(self, req: Any) -> int:
        return int(req.extend_end)

    def lock(self, cache: Any, node: Any) -> Any:
        return cache.lock(node)

    def unlock(self, cache: Any, receipt: Any) -> None:
        cache.unlock(receipt)

    def serves(self, cache: Any) -> bool:
        return True  # only UnifiedRadixCache's methods are hooked

    def cached_len(self, cache: Any, tokens: Any, namespace: Namespace) -> int:
        return _cached_len(cache, tokens, namespace)

    def peers(self, cache: Any) -> list[Any]:
        return rank_agreement.attention_peers(cache)

    def tree_match(self, params: TreeMatchParams) -> TreeMatch:
        """The tree's match of ``tokens[:end]``: the tree matches whole pages, so the pages that
        cover [0, end) are asked; the device slots are read off the last device node's path."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        cache, ns, tokens, end = params.cache, params.namespace, params.tokens, params.end
        page = int(cache.page_size)
        key_end = min(len(tokens), -(-end // page) * page)
        key = RadixKey(
            _token_array(tokens[:key_end]), extra_key=ns.extra_key, cache_salt=ns.cache_salt
        )
        found = self._donor_match(cache, MatchPrefixParams(key=key), _original_match(cache))
        on_device = min(int(found.device_prefix_len), end)
        if on_device <= 0:
            return TreeMatch(0, _host_len(found))
        node = found.last_device_node
        # on the host like the rest of a donor's path (the tree keeps them on the KV device)
        slots = cache.tree_core.collect_full_device_indices(
            node, cache.root_node_handle(ns.extra_key)
        )[:on_device].to(device="cpu", dtype=torch.int64)
        return TreeMatch(on_device, _host_len(found), slots, node)

    @staticmethod
    def _donor_match(cache: Any, params: Any, orig_match: Any) -> Any:
        """The original ``match_prefix`` of the donor's tokens (a seam for the host-tier test)."""
        return orig_match(cache, params)


def prefill_graph_wrappers(runner: type, dp_attn: Any) -> Wrappers:
    """Wrappers of ``runner.can_run_graph`` (``PrefillCudaGraphRunner``, which replays prefill
    batches on CUDA by default, its metadata from ``init_forward_metadata_out_graph``) and of
    the module function ``dp_attn._local_prefill_cuda_graph_vote`` (min-reduced across ranks
    under DP attention), built from the current originals: a batch holding a sparse request
    says no to the graph (the model runner runs it eagerly, through the hooked
    ``init_forward_metadata``) and so does this rank's vote for it, so every rank runs that step
    eagerly together. Ordinary batches keep SGLang's answer; never raises on its own."""
    can_run_graph = runner.can_run_graph
    vote: Callable[..., bool] = dp_attn._local_prefill_cuda_graph_vote

    def can_run_graph_hook(self: Any, forward_batch: Any) -> bool:
        return graph_can_carry(forward_batch) and can_run_graph(self, forward_batch)

    def vote_hook(*args: Any, **kwargs: Any) -> bool:
        batch = kwargs.get("local_batch")
        reuse = batch_state.batch_reuse(batch) if batch is not None else None
        if reuse is not None and reuse.sparse:
            return False
        return vote(*args, **kwargs)

    return {
        (runner, "can_run_graph"): can_run_graph_hook,
        (dp_attn, "_local_prefill_cuda_graph_vote"): vote_hook,
    }


def _host_len(result: Any) -> int:
    """Tokens of a match result held in host memory (HiCache), 0 without a host tier."""
    return int(getattr(result, "host_hit_length", 0) or 0)


def _token_array(tokens: Any) -> array:
    """``tokens`` (a list, an array or a numpy array of token ids) as a radix key's ``array``."""
    if isinstance(tokens, array):
        return tokens
    return array("q", tokens.tolist() if hasattr(tokens, "tolist") else tokens)


def _cached_len(cache: Any, tokens: Any, namespace: Namespace) -> int:
    """Leading tokens of ``tokens`` (any :func:`_token_array` takes) the exact cache holds
    (device and host), via the original match."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(
        _token_array(tokens), extra_key=namespace.extra_key, cache_salt=namespace.cache_salt
    )
    found = _original_match(cache)(cache, MatchPrefixParams(key=key))
    return int(found.device_prefix_len) + _host_len(found)


def _original_match(cache: Any) -> Any:
    method = type(cache).match_prefix
    return getattr(method, "__wrapped__", method)
