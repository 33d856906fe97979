"""What the method-wrapping adapters (0.5.21+ ``unified``, 0.5.15-0.5.18 ``legacy``) share: the
per-process runtime, install/remove bookkeeping, the first lookup of a request, donor
registration, and the one-pass sparse extend (the ``ScheduleBatch.prepare_for_extend`` and
``ForwardBatch.init_new`` wrappers around :mod:`.one_pass`, and the attention-backend check).

Subclasses supply the version-specific hooks, the donor match and the :class:`.one_pass.BatchFields`
of their versions; nothing here imports sglang at module level.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Hashable
from typing import Any

from semblend_sglang.config import Config
from semblend_sglang.kernels import RopeSpec
from semblend_sglang.plan import Reason

from . import attention, one_pass
from .adapter import Originals, SglangAdapter, Wrappers, install_wrappers, restore
from .one_pass import BatchFields, DonorSlots
from .request_info import eligible, namespace_for, opted_out, served_model_path
from .runtime import RequestReuse, SemblendRuntime

logger = logging.getLogger(__name__)

RUNTIME_ATTR = "_semblend_runtime"
"""Attribute of the hooked tree class that holds the installed adapter's runtime."""


class HookedAdapter(SglangAdapter):
    """An adapter that replaces sglang methods with wrappers around one :class:`SemblendRuntime`.

    Subclasses build their wrappers in ``apply`` and hand them to :meth:`_install`; ``remove``
    restores every original. Their hooks call :meth:`_plan` on a request's first match,
    :meth:`_register_donor` once its prompt is published; :meth:`_one_pass_wrappers` gives the
    wrappers that copy each batch's reused spans (:meth:`_load`) and give the computed tokens
    their true positions.
    """

    batch_fields: BatchFields = one_pass.UNIFIED_FIELDS
    """How this adapter's sglang versions name a request's row, its chunk end and tree locks."""

    backend_ok: bool | None = None
    """Whether the model runner's attention backend runs a sparse extend (None until the first
    forward shows it; the configured backend's name decides until then, where known)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.runtime = SemblendRuntime(config)
        self._originals: Originals = {}

    @classmethod
    @abstractmethod
    def _tree_class(cls) -> type:
        """The sglang tree class whose ``RUNTIME_ATTR`` names the installed runtime."""

    def is_applied(self) -> bool:
        return bool(self._originals)

    def _install(self, wrappers: Wrappers) -> None:
        self._originals = install_wrappers(wrappers)
        setattr(self._tree_class(), RUNTIME_ATTR, self.runtime)

    def remove(self) -> None:
        restore(self._originals)
        if self._originals:
            tree = self._tree_class()
            if getattr(tree, RUNTIME_ATTR, None) is self.runtime:
                delattr(tree, RUNTIME_ATTR)
        self._originals.clear()
        if self._own_attention_hooks:
            attention.remove_attention_hooks()
            self._own_attention_hooks = False

    _own_attention_hooks = False

    def _install_attention_hooks(self, *, triton: bool) -> None:
        """Install :mod:`.attention`'s torch_native hooks (and triton's when ``triton``); they
        are removed with this adapter unless something else (the CPU plugin) installed them
        first."""
        self._own_attention_hooks = not attention.hooks_installed("torch_native")
        attention.install_attention_hooks(triton=triton)

    @abstractmethod
    def _match_donor(
        self, cache: Any, state: RequestReuse, handle: Hashable, donor_end: int
    ) -> tuple[str | None, DonorSlots | None]:
        """Where donor ``handle``'s KV for its positions [0, donor_end) is, for
        :func:`.one_pass.load_batch_spans`: ``(None, DonorSlots)``, or ``(reason, None)`` when it
        is not on the device (the donor forgotten when its KV is gone for good)."""

    @abstractmethod
    def _cache_supported(self, cache: Any) -> bool:
        """True when this adapter can materialize into ``cache`` (see :meth:`_pool_supported`)."""

    def _pool_supported(self, cache: Any) -> bool:
        """The KV-pool conditions both adapters need: page size 1, per-layer K/V buffers stored
        in their own dtype (no fp8), and a RoPE the kernels support for the served model."""
        pool = cache.token_to_kv_pool_allocator.get_kvcache()
        return (
            int(cache.page_size) == 1
            and isinstance(getattr(pool, "k_buffer", None), list)
            and getattr(pool, "store_dtype", None) == getattr(pool, "dtype", None)
            and self.rope_spec() is not None
        )

    def rope_spec(self) -> RopeSpec | None:
        """RoPE of the served model (None: not supported; logged once by the runtime)."""
        return self.runtime.rope_spec(served_model_path())

    def _plan(
        self, cache: Any, req: Any, tokens: Any, limit: Any, exact_len: int
    ) -> RequestReuse | None:
        """The first lookup of ``req`` (match key ``tokens`` limited to ``limit`` + 1, exact hit
        ``exact_len``): its tracked state when a plan stands, else None (no plan, or declined as
        ``unsupported_cache`` / ``spans_trimmed_away``). Later matches of the same request, and
        substitute mode, return None without a lookup."""
        runtime = self.runtime
        rid = req.rid
        if runtime.is_tracked(rid) or not runtime.active:
            return None
        if not self.config.enabled or self.config.mode == "substitute" or not eligible(req):
            return None  # substitute mode decides at arrival
        if opted_out(req):
            runtime.opt_out(rid)
            return None
        usable = len(tokens) if limit is None else min(len(tokens), int(limit) + 1)
        namespace = namespace_for(req)
        decision = runtime.lookup(
            namespace,
            tokens[:usable],
            exact_len,
            rid,
            int(cache.page_size),
            self._donor_alive(cache, namespace),
        )
        if decision.kind != "plan" or decision.plan is None:
            return None
        state = runtime.start(rid, namespace, decision.plan)
        if not self._cache_supported(cache):
            runtime.decline(rid, Reason.UNSUPPORTED_CACHE)
            return None
        if state.spans[-1].target_end <= exact_len:
            runtime.decline(rid, Reason.SPANS_TRIMMED_AWAY)
            return None
        return state

    def _donor_alive(self, cache: Any, namespace: Any) -> Any:
        """The provider's liveness check of a candidate donor in ``cache`` (``DonorAlive``), or
        None when this adapter has none (the copy then finds evicted donors)."""
        return None

    def _register_donor(self, req: Any, published_len: int, cap: int | None = None) -> None:
        """Index ``req``'s prompt as a donor (once) when the tree now holds all of it, or, for a
        request that reused KV (``cap``: its publish cap), the exact head ``prompt[:cap]`` when
        the tree holds that: everything after it is approximate and was never published."""
        prompt = req.origin_input_ids
        end = len(prompt) if cap is None else min(int(cap), len(prompt))
        if not self.runtime.active:
            return
        if published_len >= end >= self.config.min_prompt_tokens and eligible(req):
            self.runtime.register_donor(namespace_for(req), req.rid, list(prompt[:end]))

    # ----------------------------------------------------------------- one-pass sparse extend
    def _one_pass_wrappers(self, schedule_batch: type, forward_batch: type) -> Wrappers:
        """Wrappers of ``ScheduleBatch.prepare_for_extend`` (the copy, after sglang laid the
        batch's rows out) and of the classmethod ``ForwardBatch.init_new`` (the first forward
        learns the attention backend; a batch with sparse requests gets their true positions)."""
        adapter = self
        runtime = self.runtime
        orig_prepare = schedule_batch.prepare_for_extend
        orig_init_new = forward_batch.init_new  # bound to ForwardBatch (a classmethod)

        def prepare_for_extend(self: Any, *args: Any, **kwargs: Any) -> Any:
            one_pass.clear(self)
            out = orig_prepare(self, *args, **kwargs)
            runtime.guarded("load", None, None, adapter._load, self)
            return out

        def init_new(cls: Any, batch: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
            if adapter.backend_ok is None:  # the first forward: learn the backend instance
                runtime.guarded("backend", None, None, adapter._check_backend, model_runner)
            ret = orig_init_new(batch, model_runner, *args, **kwargs)
            hook = runtime.check_hook
            if hook is not None and getattr(batch, one_pass.CHECK_ATTR, None):
                runtime.guarded("arm", None, None, hook.arm, batch, ret)
            if getattr(batch, one_pass.SPARSE_ATTR, None) and ret.positions is not None:
                if ret.forward_mode.is_decode_or_idle():
                    one_pass.clear(batch)
                else:
                    ret.positions = one_pass.forward_positions(batch, ret.positions)
            return ret

        return {
            (schedule_batch, "prepare_for_extend"): prepare_for_extend,
            (forward_batch, "init_new"): classmethod(init_new),
        }

    def _check_backend(self, model_runner: Any) -> None:
        """Set :attr:`backend_ok` from the model runner's attention backend (logged once when it
        cannot run a sparse extend: every plan is declined from then on)."""
        backend = getattr(model_runner, "attn_backend", None)
        self.backend_ok = backend is None or attention.sparse_extend_supported(backend)
        if not self.backend_ok:
            logger.warning(
                "semblend: attention backend %s cannot run a sparse extend; every plan is "
                "declined as %s",
                type(backend).__name__,
                Reason.UNSUPPORTED_CACHE,
            )

    def _load(self, batch: Any) -> None:
        """After ``prepare_for_extend``: copy the batch's reused spans (:mod:`.one_pass`). An
        error leaves the batch as sglang built it and makes its planned requests cold
        fallbacks. Where other ranks run the batch too, this takes part in their agreement on
        every prefill batch, planned here or not (:mod:`.rank_agreement`)."""
        runtime = self.runtime
        cache = batch.tree_cache
        if cache is None:
            return
        peers = self.batch_fields.peers(cache)
        if not peers and (
            not runtime.has_plans or all(runtime.state_of(r.rid) is None for r in batch.reqs)
        ):
            return
        spec = self.rope_spec()
        refused = None if spec is not None else Reason.UNSUPPORTED_CACHE
        if runtime.layer_check is False:
            refused = Reason.UNSUPPORTED_MODEL
        if refused is not None:
            for req in batch.reqs:
                state = runtime.state_of(req.rid)
                if state is not None and state.open and not state.reused_any:
                    runtime.decline(req.rid, refused)
            if not peers:
                return
        before = {r.rid: s.reused_total for r in batch.reqs if (s := runtime.state_of(r.rid))}
        try:
            one_pass.load_batch_spans(
                runtime,
                cache,
                batch,
                self._match_donor,
                spec,
                self.batch_fields,
                peers,
                check=runtime.check_layer_active,
            )
        except Exception as exc:  # the batch is unchanged: its requests compute every position
            for req in batch.reqs:
                if runtime.state_of(req.rid) is not None:
                    runtime.fail("load", exc, req.rid)
            return
        if self.config.report_reuse_to_client:
            self._report_reused(batch, before)

    def _report_reused(self, batch: Any, before: dict[str, int]) -> None:
        """``report_reuse_to_client``: add the tokens this chunk copied to each request's
        ``cached_tokens`` (sglang counted the chunk's exact prefix already)."""
        for req in batch.reqs:
            state = self.runtime.state_of(req.rid)
            copied = 0 if state is None else state.reused_total - before.get(req.rid, 0)
            if copied > 0:
                req.cached_tokens += copied
                if hasattr(req, "cached_tokens_device"):
                    req.cached_tokens_device += copied
