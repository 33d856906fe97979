"""What the method-wrapping adapters (0.5.21+ ``unified``, 0.5.15-0.5.18 ``legacy``) share: the
per-process runtime, install/remove bookkeeping, the first lookup of a request, donor
registration, and the K/V copy into a request's own slots.

Subclasses supply the version-specific hooks; nothing here imports sglang at module level.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from semblend_sglang.config import Config
from semblend_sglang.kernels import RopeSpec
from semblend_sglang.plan import Reason

from .adapter import Originals, SglangAdapter, Wrappers, install_wrappers, restore
from .request_info import eligible, namespace_for, served_model_path
from .runtime import RequestReuse, SemblendRuntime

RUNTIME_ATTR = "_semblend_runtime"
"""Attribute of the hooked tree class that holds the installed adapter's runtime."""


class HookedAdapter(SglangAdapter):
    """An adapter that replaces sglang methods with wrappers around one :class:`SemblendRuntime`.

    Subclasses build their wrappers in ``apply`` and hand them to :meth:`_install`; ``remove``
    restores every original. Their hooks call :meth:`_plan` on a request's first match,
    :meth:`_register_donor` once its prompt is published.
    """

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


def copy_span_kv(
    cache: Any, src: torch.Tensor, state: RequestReuse, row: int, spec: RopeSpec
) -> torch.Tensor | None:
    """Give the request (req_to_token row ``row``) new slots of its own for the current span
    [a', b') of ``state`` and fill them with the donor slots ``src``' K (rotated by the span's
    delta) and V; write them into the row. Returns the new slots, or None when the allocator
    has no room even after evicting. The caller holds a lock on the donor's path. On an error
    the new slots are freed and the error propagates."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    from semblend_sglang.kernels import transfer_kv_sglang

    allocator = cache.token_to_kv_pool_allocator
    pool = allocator.get_kvcache()
    n = state.reused_tokens
    if allocator.available_size() < n:
        evict_from_tree_cache(cache, n)
    dst = allocator.alloc(n)
    if dst is None:
        return None
    try:
        deltas = torch.full((n,), state.delta, dtype=torch.int64, device=src.device)
        transfer_kv_sglang(pool.k_buffer, pool.v_buffer, src.to(dst.device), dst, deltas, spec)
        if dst.is_cuda:
            torch.cuda.current_stream(dst.device).synchronize()
        cache.req_to_token_pool.write((row, slice(state.boundary, state.end)), dst.to(torch.int32))
    except BaseException:
        allocator.free(dst)
        raise
    return dst
