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
   that reused KV donates its exact head only, the prompt before its publish cap.

substitute (opt-in, output-changing): ``Scheduler._add_request_to_queue`` rewrites an arriving
request's prompt T to D[:a0] + T[a:] for its plan's first span [a, b) <- donor D [a0, b0), once
the provider's similarity gate passed; SGLang's exact prefix cache then serves D[:b0] unchanged.
No KV is copied and nothing approximate exists. The hooks above stand aside for such requests.

Any failure declines the plan or makes it a cold fallback; the request continues normally.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason

from . import attention, one_pass
from .hooked_adapter import HookedAdapter
from .runtime import RequestReuse
from .scheduler_hooks import (
    wrap_add_request_to_queue,
    wrap_get_internal_state,
    wrap_scheduler_init,
)
from .substitute import substitute_request

logger = logging.getLogger(__name__)


def attention_supported() -> bool:
    """False (logged once) when the server's prefill attention backend cannot run a sparse
    extend; True when it can or when no server context exists (the cache alone, as in an
    in-process cache harness)."""
    global _unsupported_logged
    try:
        from sglang.srt.runtime_context import attention_backends

        prefill, _ = attention_backends()
    except Exception:
        return True
    if prefill is None or str(prefill) in attention.SPARSE_EXTEND_BACKENDS:
        return True
    if not _unsupported_logged:
        _unsupported_logged = True
        logger.warning(
            "semblend: prefill attention backend %s cannot run a sparse extend (supported: %s); "
            "every plan is declined as %s",
            prefill,
            ", ".join(sorted(attention.SPARSE_EXTEND_BACKENDS)),
            Reason.UNSUPPORTED_CACHE,
        )
    return False


_unsupported_logged = False


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
        orig_match = UnifiedRadixCache.match_prefix
        orig_checkpoint = UnifiedRadixCache.checkpoint
        orig_on_release = UnifiedRadixCache.on_release
        orig_reset = UnifiedRadixCache.reset
        orig_finish = UnifiedRadixCache.finish
        orig_prepare = ScheduleBatch.prepare_for_extend
        orig_init_new = ForwardBatch.init_new  # bound to ForwardBatch (a classmethod)
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
            state = runtime.requests.get(getattr(req, "rid", None))
            if state is not None and state.reused_any:
                up_to = min(up_to, state.publish_cap)
            orig_checkpoint(self, req, up_to=up_to, **kwargs)
            rid = getattr(req, "rid", None)
            runtime.guarded("checkpoint", rid, None, adapter._after_checkpoint, req, up_to)

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

        def prepare_for_extend(self: Any) -> Any:
            one_pass.clear(self)
            out = orig_prepare(self)
            runtime.guarded("load", None, None, adapter._load, self)
            return out

        def init_new(cls: Any, batch: Any, model_runner: Any, **kwargs: Any) -> Any:
            if adapter.backend_ok is None:  # the first forward: learn the backend instance
                runtime.guarded("backend", None, None, adapter._check_backend, model_runner)
            ret = orig_init_new(batch, model_runner, **kwargs)
            if getattr(batch, one_pass.SPARSE_ATTR, None) and ret.positions is not None:
                if ret.forward_mode.is_decode_or_idle():
                    one_pass.clear(batch)
                else:
                    ret.positions = one_pass.forward_positions(batch, ret.positions)
            return ret

        replacements = {
            (UnifiedRadixCache, "match_prefix"): match_prefix,
            (UnifiedRadixCache, "checkpoint"): checkpoint,
            (UnifiedRadixCache, "on_release"): on_release,
            (UnifiedRadixCache, "reset"): reset,
            (UnifiedRadixCache, "finish"): finish,
            (ScheduleBatch, "prepare_for_extend"): prepare_for_extend,
            (ForwardBatch, "init_new"): classmethod(init_new),
            (SchedulerInternalStateController, "get_internal_state"): wrap_get_internal_state(
                orig_internal_state, runtime
            ),
            (Scheduler, "_add_request_to_queue"): wrap_add_request_to_queue(
                orig_add_to_queue, runtime, adapter._substitute
            ),
            (Scheduler, "__init__"): wrap_scheduler_init(orig_scheduler_init, runtime),
        }
        self._install(replacements)
        self._own_attention_hooks = not attention.hooks_installed("torch_native")
        attention.install_attention_hooks()

    def remove(self) -> None:
        super().remove()
        if getattr(self, "_own_attention_hooks", False):
            attention.remove_attention_hooks()
            self._own_attention_hooks = False

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

    backend_ok: bool | None = None
    """Whether the model runner's attention backend runs a sparse extend (None until the first
    forward shows it; the configured backend's name decides until then)."""

    def _check_backend(self, model_runner: Any) -> None:
        backend = getattr(model_runner, "attn_backend", None)
        self.backend_ok = backend is None or attention.sparse_extend_supported(backend)
        if not self.backend_ok:
            logger.warning(
                "semblend: attention backend %s cannot run a sparse extend; every plan is "
                "declined as %s",
                type(backend).__name__,
                Reason.UNSUPPORTED_CACHE,
            )

    # ----------------------------------------------------------------- 2. copy, sparse extend
    def _load(self, batch: Any) -> None:
        """After ``prepare_for_extend``: copy the batch's reused spans (:mod:`.one_pass`)."""
        runtime = self.runtime
        if not runtime.requests or not any(r.rid in runtime.requests for r in batch.reqs):
            return
        spec = self.rope_spec()
        cache = batch.tree_cache
        if spec is None or cache is None:
            for req in batch.reqs:
                if req.rid in runtime.requests and not runtime.requests[req.rid].reused_any:
                    runtime.decline(req.rid, Reason.UNSUPPORTED_CACHE)
            return
        try:
            one_pass.load_batch_spans(runtime, cache, batch, self._match_donor, spec)
        except Exception as exc:  # the batch is unchanged: its requests compute every position
            for req in batch.reqs:
                if req.rid in runtime.requests:
                    runtime.fail("load", exc, req.rid)

    # ----------------------------------------------------------------- 3. publish
    def _after_checkpoint(self, req: Any, up_to: int) -> None:
        state = self.runtime.requests.get(req.rid)
        if state is not None and state.reused_any:
            # only its exact head (before the publish cap) is in the tree: a donor of that
            self._register_donor(req, up_to, cap=state.publish_cap)
            return
        self._register_donor(req, up_to)

    def _match_donor(
        self, cache: Any, state: RequestReuse, handle: Any, donor_end: int
    ) -> tuple[str | None, Any]:
        """Match donor ``handle``'s tokens up to ``donor_end`` in the tree: (None, match) when
        they are on the device; (donor_on_host, match) when HiCache holds the rest in host
        memory (the donor is kept: it is used again once SGLang's own load-back, an exact hit on
        it, brings it to the device); (donor_evicted, None) otherwise, and the donor is
        forgotten."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        donor = self.runtime.donor_tokens(handle)
        if donor is not None and len(donor) >= donor_end:
            ns = state.namespace
            key = RadixKey(
                array("q", donor[:donor_end].tolist()),
                extra_key=ns.extra_key,
                cache_salt=ns.cache_salt,
            )
            found = self._donor_match(
                cache, MatchPrefixParams(key=key), self._original_match(cache)
            )
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
