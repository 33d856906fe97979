"""Adapter for sglang >= 0.5.21: hooks on ``UnifiedRadixCache`` and ``PrefillAdder``.

exact_spans, per request T with exact hit m and plan [a', b') <- donor [a0', b0'):

1. ``UnifiedRadixCache.match_prefix``: the original runs and its result is returned unchanged
   (the exact cache stays authoritative); the provider is asked once per request id.
2. ``PrefillAdder._select_prefill_admission`` / ``add_chunked_req``: the prefill chunk that would
   cross a' is cut at a', so the request first computes its own head T[m:a').
3. ``UnifiedRadixCache.checkpoint`` at up_to == a' (the scheduler stashing that chunk): T[0:a')
   is published as usual; then the donor's path is re-matched and locked, the request gets new
   slots of its own for [a', b'), the fused kernel copies the donor's K (rotated by a' - a0') and V
   into them, and the request's prefix is extended to b'. The scheduler computes T[b':n].
4. Every later ``checkpoint`` of that request is capped at a': nothing from a' on (reused KV, and
   everything computed after it) reaches the tree; SGLang's release frees those slots, which only
   this request ever owned.
5. A request whose prompt is published becomes a donor (the provider keeps its token ids).

substitute (opt-in, output-changing): ``Scheduler._add_request_to_queue`` rewrites an arriving
request's prompt T to D[:a0] + T[a:] for its plan's first span [a, b) <- donor D [a0, b0), once
the provider's similarity gate passed; SGLang's exact prefix cache then serves D[:b0] unchanged.
No KV is copied and nothing approximate exists: the model sees the donor's head instead of the
request's own. The hooks above stand aside for such requests.

Any failure declines the plan or makes it a cold fallback; the request continues normally.
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any

import torch

from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason

from .hooked_adapter import RUNTIME_ATTR, HookedAdapter, copy_span_kv
from .runtime import RequestReuse, SemblendRuntime
from .scheduler_hooks import (
    wrap_add_chunked_req,
    wrap_add_request_to_queue,
    wrap_get_internal_state,
)
from .substitute import substitute_request

_CUT_ATTR = "_semblend_cut_at_boundary"


class UnifiedRadixCacheAdapter(HookedAdapter):
    """Hooks for sglang 0.5.21+ (``UnifiedRadixCache``; Rust or Python tree core)."""

    name = "unified-radix-cache"

    @classmethod
    def supports(cls, version: Any) -> bool:
        from packaging.version import Version

        return bool(Version("0.5.21") <= version < Version("0.6"))

    # ----------------------------------------------------------------- install
    def apply(self) -> None:
        if self._originals:
            return
        from sglang.srt.managers.schedule_policy import PrefillAdder
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.internal_state import (
            SchedulerInternalStateController,
        )
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        adapter = self
        runtime = self.runtime
        orig_match = UnifiedRadixCache.match_prefix
        orig_checkpoint = UnifiedRadixCache.checkpoint
        orig_on_release = UnifiedRadixCache.on_release
        orig_reset = UnifiedRadixCache.reset
        orig_finish = UnifiedRadixCache.finish
        orig_select = PrefillAdder._select_prefill_admission
        orig_add_chunked = PrefillAdder.add_chunked_req
        orig_internal_state = SchedulerInternalStateController.get_internal_state
        orig_add_to_queue = Scheduler._add_request_to_queue

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
            state = runtime.requests.get(getattr(req, "rid", None))
            requested = up_to
            if state is not None and state.reused_any:
                up_to = min(up_to, state.publish_cap)
            orig_checkpoint(self, req, up_to=up_to, **kwargs)
            rid = getattr(req, "rid", None)
            runtime.guarded(
                "checkpoint", rid, None, adapter._after_checkpoint, self, req, requested, orig_match
            )

        def on_release(self: Any, req: Any, *, checkpointed: bool) -> None:
            orig_on_release(self, req, checkpointed=checkpointed)
            runtime.guarded("release", None, None, runtime.release, req.rid)

        def finish(self: Any, handle: Any, outcome: Any) -> None:
            orig_finish(self, handle, outcome)
            if outcome is not CacheRequestOutcome.SUCCESS:  # aborted: maybe never released
                runtime.guarded("abort", None, None, runtime.abort, handle.rid)

        def reset(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig_reset(self, *args, **kwargs)
            # /flush_cache and friends: every donor's KV is gone
            runtime.guarded("reset", None, None, runtime.forget_all_donors)
            return out

        def _select_prefill_admission(self: Any, req: Any, **kwargs: Any) -> Any:
            if getattr(self, _CUT_ATTR, False):
                # A chunk was cut short at a reuse boundary in this step: admit nothing more,
                # as SGLang does after a chunked request (it tracks one chunked request).
                from sglang.srt.managers.schedule_policy import AddReqResult

                return AddReqResult.OTHER
            admission = orig_select(self, req, **kwargs)
            rid = getattr(req, "rid", None)
            return runtime.guarded(
                "admission", rid, admission, adapter._cut_admission, self, req, admission, kwargs
            )

        replacements = {
            (UnifiedRadixCache, "match_prefix"): match_prefix,
            (UnifiedRadixCache, "checkpoint"): checkpoint,
            (UnifiedRadixCache, "on_release"): on_release,
            (UnifiedRadixCache, "reset"): reset,
            (UnifiedRadixCache, "finish"): finish,
            (PrefillAdder, "_select_prefill_admission"): _select_prefill_admission,
            (PrefillAdder, "add_chunked_req"): wrap_add_chunked_req(
                orig_add_chunked, runtime, adapter._cut_continuation
            ),
            (SchedulerInternalStateController, "get_internal_state"): wrap_get_internal_state(
                orig_internal_state, runtime
            ),
            (Scheduler, "_add_request_to_queue"): wrap_add_request_to_queue(
                orig_add_to_queue, runtime, adapter._substitute
            ),
        }
        self._install(replacements)

    @classmethod
    def _tree_class(cls) -> type:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        return UnifiedRadixCache

    # ----------------------------------------------------------------- 1. lookup
    def _on_match(self, cache: Any, params: Any, req: Any, result: Any) -> None:
        exact_len = int(result.device_prefix_len) + int(getattr(result, "host_hit_length", 0) or 0)
        key = params.key
        state = self._plan(cache, req, key.token_ids, getattr(key, "limit", None), exact_len)
        if state is None:
            return
        reason, _ = self._match_donor(cache, state, self._original_match(cache))
        if reason is not None:  # checked again at the copy; this spares a needless chunk cut
            self.runtime.decline(req.rid, reason)

    def _cache_supported(self, cache: Any) -> bool:
        return self._pool_supported(cache)

    # ----------------------------------------------------------------- 2. chunk at a'
    def _cut_admission(self, adder: Any, req: Any, admission: Any, kwargs: dict[str, Any]) -> Any:
        state = self.runtime.requests.get(req.rid)
        if state is None or state.phase != "planned" or not hasattr(admission, "extend_len"):
            return admission
        start = int(admission.prefix_len)
        end = start + int(admission.extend_len)
        if state.boundary <= start:
            self.runtime.decline(req.rid, Reason.SPANS_TRIMMED_AWAY)
            return admission
        if state.boundary >= end:
            if admission.is_chunked:
                state.phase = "head"  # the cut happens in a later chunk
            return admission
        if kwargs.get("has_chunked_req") or adder.new_chunked_req is not None:
            self.runtime.decline(req.rid, Reason.CHUNK_SLOT_BUSY)
            return admission
        state.phase = "head"
        setattr(adder, _CUT_ATTR, True)
        return dataclasses.replace(
            admission, extend_len=state.boundary - start, is_chunked=True, max_new_tokens=0
        )

    def _cut_continuation(self, adder: Any, req: Any, out: Any) -> Any:
        state = self.runtime.requests.get(req.rid)
        if state is None or state.phase != "head":
            return out
        if req.prefix_len < state.boundary < req.extend_end:
            req.extend_end = state.boundary
            setattr(adder, _CUT_ATTR, True)
            return req
        return out

    # ----------------------------------------------------------------- 3. materialize
    def _after_checkpoint(self, cache: Any, req: Any, up_to: int, orig_match: Any) -> None:
        runtime = self.runtime
        state = runtime.requests.get(req.rid)
        if state is not None and state.phase == "head" and up_to == state.boundary:
            if req.finished() or req.extend_end != state.boundary:
                runtime.decline(req.rid, Reason.ENGINE_DECLINED)
                return
            self._materialize(cache, req, state, orig_match)
            return
        if state is not None and (state.phase == "materialized" or state.reused_any):
            return  # its prompt is not in the tree past the publish cap: not a donor
        self._register_donor(req, up_to)

    def _materialize(self, cache: Any, req: Any, state: RequestReuse, orig_match: Any) -> None:
        runtime = self.runtime
        rid = req.rid
        donor_end = state.donor_start + state.reused_tokens
        ns = state.namespace
        reason, found = self._match_donor(cache, state, orig_match)
        if reason is not None:
            runtime.decline(rid, reason)
            return
        spec = self.rope_spec()
        if spec is None:
            runtime.decline(rid, Reason.UNSUPPORTED_CACHE)
            return
        n = state.reused_tokens
        lock = cache.lock(found.last_device_node)
        try:
            path = cache.tree_core.collect_full_device_indices(
                found.last_device_node, cache.root_node_handle(ns.extra_key)
            )
            src = path[state.donor_start : donor_end].to(torch.int64)
            dst = copy_span_kv(cache, src, state, req.kv.req_pool_idx, spec)
        finally:
            cache.unlock(lock)
        if dst is None:
            runtime.decline(rid, Reason.NO_CAPACITY)
            return
        req.kv.kv_allocated_len = state.end
        req.kv.kv_committed_len = state.end
        req.extend_end = state.end  # checkpoint_kv_cache sets prefix_len = extend_end
        state.reused_total += n
        if state.index + 1 == len(state.spans):
            runtime.finish_reuse(rid)
            return
        state.index += 1  # the scheduler computes [end, next boundary) first, then we copy
        state.phase = "head"
        if state.boundary == req.extend_end:  # adjacent spans: nothing to compute between
            self._materialize(cache, req, state, orig_match)

    def _match_donor(
        self, cache: Any, state: RequestReuse, orig_match: Any
    ) -> tuple[str | None, Any]:
        """Match the donor's tokens up to its span's end in the tree: (None, match) when the span
        is on the device; (donor_on_host, match) when HiCache holds the rest in host memory (the
        donor is kept: it is used again once SGLang's own load-back, an exact hit on it, brings
        it to the device); (donor_evicted, None) otherwise, and the donor is forgotten."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        handle = state.plan.donor_handle
        donor = self.runtime.donor_tokens(handle)
        donor_end = state.donor_start + state.reused_tokens
        if donor is not None and len(donor) >= donor_end:
            ns = state.namespace
            key = RadixKey(
                array("q", donor[:donor_end].tolist()),
                extra_key=ns.extra_key,
                cache_salt=ns.cache_salt,
            )
            found = self._donor_match(cache, MatchPrefixParams(key=key), orig_match)
            on_device = int(found.device_prefix_len)
            if on_device >= donor_end:
                return None, found
            if on_device + int(getattr(found, "host_hit_length", 0) or 0) >= donor_end:
                return Reason.DONOR_ON_HOST, found
        self.runtime.provider.forget(handle)
        return Reason.DONOR_EVICTED, None

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


def runtime_of_installed() -> SemblendRuntime | None:
    """The runtime of the adapter currently installed in this process, if any."""
    try:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except Exception:
        return None
    runtime: SemblendRuntime | None = getattr(UnifiedRadixCache, RUNTIME_ATTR, None)
    return runtime
