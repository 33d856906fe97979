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

from semblend_sglang.config import Config
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason, ReusePlan

from .adapter import Originals, SglangAdapter, install_wrappers, restore
from .runtime import RequestReuse, SemblendRuntime

_RUNTIME_ATTR = "_semblend_runtime"
_CUT_ATTR = "_semblend_cut_at_boundary"


def _server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:
        return None


def served_tokenizer_path() -> str | None:
    """The running server's tokenizer (or model) path, None outside a server."""
    args = _server_args()
    path = getattr(args, "tokenizer_path", None) or getattr(args, "model_path", None)
    return None if path is None else str(path)


def _namespace_for(req: Any) -> Namespace:
    args = _server_args()
    model = str(getattr(args, "served_model_name", None) or getattr(args, "model_path", "") or "")
    tokenizer = str(getattr(args, "tokenizer_path", None) or getattr(args, "model_path", "") or "")
    return Namespace(
        model=model,
        tokenizer_fingerprint=tokenizer,
        adapter=getattr(req, "lora_id", None),
        extra_key=getattr(req, "extra_key", None),
        cache_salt=getattr(req, "cache_salt", None),
    )


def _eligible(req: Any) -> bool:
    return (
        getattr(req, "multimodal_inputs", None) is None
        and getattr(req, "positional_embed_overrides", None) is None
        and getattr(req, "session", None) is None
        and not (hasattr(req, "is_dllm") and req.is_dllm())
    )


class UnifiedRadixCacheAdapter(SglangAdapter):
    """Hooks for sglang 0.5.21+ (``UnifiedRadixCache``; Rust or Python tree core)."""

    name = "unified-radix-cache"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.runtime = SemblendRuntime(config)
        self._originals: Originals = {}

    @classmethod
    def supports(cls, version: Any) -> bool:
        from packaging.version import Version

        return bool(Version("0.5.21") <= version < Version("0.6"))

    # ----------------------------------------------------------------- install
    def is_applied(self) -> bool:
        return bool(self._originals)

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

        from .http_routes import CONFIG_KEY, STATE_KEY

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

        def add_chunked_req(self: Any, req: Any) -> Any:
            out = orig_add_chunked(self, req)
            rid = getattr(req, "rid", None)
            return runtime.guarded(
                "chunked_admission", rid, out, adapter._cut_continuation, self, req, out
            )

        def _add_request_to_queue(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
            retracted = kwargs.get("is_retracted", args[0] if args else False)
            if adapter.config.mode == "substitute" and not retracted:
                rid = getattr(req, "rid", None)
                runtime.guarded("substitute", rid, None, adapter._substitute, self, req)
            return orig_add_to_queue(self, req, *args, **kwargs)

        def get_internal_state(self: Any, recv_req: Any) -> Any:
            out = orig_internal_state(self, recv_req)
            try:
                out.internal_state[STATE_KEY] = runtime.provider.snapshot()
                out.internal_state[CONFIG_KEY] = adapter.config.as_dict()
            except Exception as exc:
                runtime.fail("internal_state", exc)
            return out

        replacements = {
            (UnifiedRadixCache, "match_prefix"): match_prefix,
            (UnifiedRadixCache, "checkpoint"): checkpoint,
            (UnifiedRadixCache, "on_release"): on_release,
            (UnifiedRadixCache, "reset"): reset,
            (UnifiedRadixCache, "finish"): finish,
            (PrefillAdder, "_select_prefill_admission"): _select_prefill_admission,
            (PrefillAdder, "add_chunked_req"): add_chunked_req,
            (SchedulerInternalStateController, "get_internal_state"): get_internal_state,
            (Scheduler, "_add_request_to_queue"): _add_request_to_queue,
        }
        self._originals = install_wrappers(replacements)
        setattr(UnifiedRadixCache, _RUNTIME_ATTR, runtime)

    def remove(self) -> None:
        restore(self._originals)
        if self._originals:
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            if getattr(UnifiedRadixCache, _RUNTIME_ATTR, None) is self.runtime:
                delattr(UnifiedRadixCache, _RUNTIME_ATTR)
        self._originals.clear()

    # ----------------------------------------------------------------- 1. lookup
    def _on_match(self, cache: Any, params: Any, req: Any, result: Any) -> None:
        runtime = self.runtime
        rid = req.rid
        if rid in runtime.requests or rid in runtime.settled:
            return
        if not self.config.enabled or self.config.mode == "substitute" or not _eligible(req):
            return  # substitute mode decides at arrival (_substitute)
        tokens = params.key.token_ids
        limit = getattr(params.key, "limit", None)
        usable = len(tokens) if limit is None else min(len(tokens), int(limit) + 1)
        exact_len = int(result.device_prefix_len) + int(getattr(result, "host_hit_length", 0) or 0)
        namespace = _namespace_for(req)
        decision = runtime.provider.lookup(
            namespace, tokens[:usable], exact_len, rid, page_size=int(cache.page_size)
        )
        if decision.kind != "plan" or decision.plan is None:
            return
        state = runtime.start(rid, namespace, decision.plan)
        if not self._cache_supported(cache):
            runtime.decline(rid, Reason.UNSUPPORTED_CACHE)
            return
        if state.boundary <= exact_len:
            runtime.decline(rid, Reason.SPANS_TRIMMED_AWAY)
            return
        reason, _ = self._match_donor(cache, state, self._original_match(cache))
        if reason is not None:  # checked again at the copy; this spares a needless chunk cut
            runtime.decline(rid, reason)

    def _cache_supported(self, cache: Any) -> bool:
        pool = cache.token_to_kv_pool_allocator.get_kvcache()
        k_buffer = getattr(pool, "k_buffer", None)
        return (
            int(cache.page_size) == 1
            and isinstance(k_buffer, list)
            and getattr(pool, "store_dtype", None) == getattr(pool, "dtype", None)
            and self.runtime.rope_spec(getattr(_server_args(), "model_path", None)) is not None
        )

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
        prompt = req.origin_input_ids
        if up_to >= len(prompt) >= runtime.config.min_prompt_tokens and _eligible(req):
            runtime.register_donor(_namespace_for(req), req.rid, list(prompt))

    def _materialize(self, cache: Any, req: Any, state: RequestReuse, orig_match: Any) -> None:
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        from semblend_sglang.kernels import transfer_kv_sglang

        runtime = self.runtime
        rid = req.rid
        donor_end = state.donor_start + state.reused_tokens
        ns = state.namespace
        reason, found = self._match_donor(cache, state, orig_match)
        if reason is not None:
            runtime.decline(rid, reason)
            return
        spec = runtime.rope_spec(getattr(_server_args(), "model_path", None))
        if spec is None:
            runtime.decline(rid, Reason.UNSUPPORTED_CACHE)
            return
        allocator = cache.token_to_kv_pool_allocator
        pool = allocator.get_kvcache()
        n = state.reused_tokens
        lock = cache.lock(found.last_device_node)
        try:
            path = cache.tree_core.collect_full_device_indices(
                found.last_device_node, cache.root_node_handle(ns.extra_key)
            )
            src = path[state.donor_start : donor_end].to(torch.int64)
            if allocator.available_size() < n:
                evict_from_tree_cache(cache, n)
            dst = allocator.alloc(n)
            if dst is None:
                runtime.decline(rid, Reason.NO_CAPACITY)
                return
            try:
                deltas = torch.full((n,), state.delta, dtype=torch.int64, device=src.device)
                transfer_kv_sglang(
                    pool.k_buffer, pool.v_buffer, src.to(dst.device), dst, deltas, spec
                )
                if dst.is_cuda:
                    torch.cuda.current_stream(dst.device).synchronize()
                cache.req_to_token_pool.write(
                    (req.kv.req_pool_idx, slice(state.boundary, state.end)), dst.to(torch.int32)
                )
            except BaseException:
                allocator.free(dst)
                raise
        finally:
            cache.unlock(lock)
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
        """Rewrite an arriving request's head to its donor's (substitute mode; see module doc)."""
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        runtime = self.runtime
        rid = req.rid
        cache = getattr(scheduler, "tree_cache", None)
        if not self.config.enabled or not _eligible(req) or rid in runtime.settled:
            return
        if not isinstance(cache, UnifiedRadixCache) or cache.disable:
            return
        tokens = req.origin_input_ids
        namespace = _namespace_for(req)
        exact_len = self._cached_len(cache, tokens, namespace)
        decision = runtime.provider.lookup(
            namespace, tokens, exact_len, rid, page_size=int(cache.page_size)
        )
        if decision.kind != "plan" or decision.plan is None:
            return
        runtime.settled.add(rid)  # decided here; the match hooks leave it alone
        plan = decision.plan
        donor = runtime.donor_tokens(plan.donor_handle)
        new_prompt = substituted_prompt(tokens, donor, plan)
        if new_prompt is None:
            runtime.provider.forget(plan.donor_handle)
            runtime.provider.record_declined(rid, Reason.DONOR_EVICTED)
            return
        max_new = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None) or 0
        context_len = int(getattr(scheduler.model_config, "context_len", 0) or 0)
        if len(new_prompt) >= int(scheduler.max_req_input_len) or (
            context_len and len(new_prompt) + int(max_new) > context_len
        ):
            runtime.provider.record_declined(rid, Reason.ENGINE_DECLINED)
            return
        span = plan.spans[0]
        shift = span.donor_start - span.target_start
        logprob_start = int(getattr(req, "logprob_start_len", -1))
        if getattr(req, "return_logprob", False) and 0 <= logprob_start < span.target_start:
            # Input logprobs over the replaced head would score the donor's tokens.
            runtime.provider.record_declined(rid, Reason.ENGINE_DECLINED)
            return
        served = self._cached_len(cache, new_prompt, namespace)
        if served < span.donor_start + span.length:
            runtime.provider.forget(plan.donor_handle)  # its KV left the tree
            runtime.provider.record_declined(rid, Reason.DONOR_EVICTED)
            return
        if req.origin_input_ids_unpadded is req.origin_input_ids:
            req.origin_input_ids_unpadded = new_prompt
        req.origin_input_ids = new_prompt
        req.full_untruncated_fill_ids = new_prompt + req.output_ids
        if logprob_start >= 0:
            req.logprob_start_len = logprob_start + shift  # same tokens, new positions
        runtime.provider.record_materialized(rid, max(0, served - exact_len))

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


def substituted_prompt(tokens: Any, donor: Any, plan: ReusePlan) -> array | None:
    """Substitute mode's rewritten prompt: ``donor[:a0] + tokens[a:]`` for the plan's first span
    [a, b) <- [a0, b0) (so the new prompt starts with ``donor[:b0]``), as an ``array("q")``.

    None when the donor's tokens are gone or do not match the span (the donor was dropped).
    """
    span = plan.spans[0]
    if donor is None or len(donor) < span.donor_start + span.length:
        return None
    head = [int(t) for t in donor[: span.donor_start]]
    same = donor[span.donor_start : span.donor_start + span.length]
    tail = tokens[span.target_start :]
    if [int(t) for t in same] != [int(t) for t in tail[: span.length]]:
        return None
    return array("q", head) + array("q", tail)


def runtime_of_installed() -> SemblendRuntime | None:
    """The runtime of the adapter currently installed in this process, if any."""
    try:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except Exception:
        return None
    runtime: SemblendRuntime | None = getattr(UnifiedRadixCache, _RUNTIME_ATTR, None)
    return runtime
