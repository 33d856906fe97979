"""Whether this server can take reused KV: the cache (served by the version's adapter), its KV
pool, the served model's RoPE and the attention backend (the server's at start-up, the model
runner's from its first forward). Owned by :class:`.request_flow.RequestFlow` (its
``support``), read on the scheduler's thread before a plan is made; reads only.
"""

from __future__ import annotations

from typing import Any

from semblend_sglang.kernels import RopeSpec

from ..attention import backends
from ..request_info import served_model_path
from ..runtime import SemblendRuntime
from ..version_view import VersionView


class EngineSupport:
    """The conditions every plan needs of the engine, for one scheduler process. Never raises
    but where sglang's objects lack what it reads (the flow guards its callers)."""

    def __init__(self, runtime: SemblendRuntime, view: VersionView) -> None:
        self._runtime = runtime
        self._view = view
        self.backend_ok: bool | None = None
        """Whether the model runner's attention backend runs a sparse extend (None until the
        first forward shows it: :meth:`learn_backend`)."""

    def cache_supported(self, cache: Any) -> bool:
        """The adapter serves the cache, its pool can take reused KV, and the attention backend
        runs a sparse extend (the server's, at start-up; the model runner's, from its first
        forward)."""
        return (
            self._view.serves(cache)
            and self.pool_supported(cache)
            and backends.attention_supported()
            and self.backend_ok is not False
        )

    def pool_supported(self, cache: Any) -> bool:
        """The KV-pool conditions of every version: per-layer K/V buffers stored in their own
        dtype (no fp8) and a RoPE the kernels support for the served model. Any page size where
        the version is ``paged``: spans are copied per token into the request's own fresh
        slots, and the tree publishes and frees whole pages."""
        pool = cache.token_to_kv_pool_allocator.get_kvcache()
        return (
            (self._view.paged or int(cache.page_size) == 1)
            and isinstance(getattr(pool, "k_buffer", None), list)
            and getattr(pool, "store_dtype", None) == getattr(pool, "dtype", None)
            and self.rope_spec() is not None
        )

    def rope_spec(self) -> RopeSpec | None:
        """RoPE of the served model (None: not supported; logged once by the runtime)."""
        return self._runtime.rope_spec(served_model_path())

    def learn_backend(self, model_runner: Any) -> None:
        """Set :attr:`backend_ok` from the model runner's attention backend (the flow calls it
        at the first forward)."""
        self.backend_ok = backends.runner_supported(model_runner)
