"""SemBlendConnector: semantic KV reuse for vLLM through its KVConnectorBase_V1 interface.

Load it with::

    --kv-transfer-config '{"kv_connector": "SemBlendConnector",
      "kv_connector_module_path": "semblend_sglang.patches.vllm.connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"mode": "exact_prefix"}}'

Written against vLLM 0.32.0 (docs/vllm.md). The scheduler-side instance finds donors and plans
loads (:mod:`.scheduler_side`); each worker-side instance copies donor KV into the request's own
blocks before the forward (:mod:`.worker_side`). Loads are synchronous. Every method is fail-open:
an exception inside semblend is counted, logged once, and answered as "nothing to load" (or, once
vLLM already counts tokens as loaded, as a failed load that vLLM recomputes). Configuration errors
are raised from the constructor, at engine start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from semblend_sglang.kernels import RopeSpec
from semblend_sglang.once_log import OnceLog

from . import SUPPORTED_VLLM, installed_vllm_version
from .engine_checks import check_engine_settings, rope_spec_for, unsupported_reason
from .metadata import SemBlendConnectorMetadata
from .scheduler_side import SchedulerSide
from .settings import settings_from_extra_config
from .stats import (
    DECLINED_PREFIX,
    OUTCOME_PREFIX,
    SemBlendKVConnectorStats,
    SemBlendPromMetrics,
    counter_deltas,
)
from .worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

T = TypeVar("T")

HAS_MODEL_HOOK = hasattr(KVConnectorBase_V1, "register_model")
"""Whether the installed vLLM calls ``register_model(model)`` on worker connectors (the first
form of vLLM PR 37339, "Add register_model() to KVConnectorBase_V1")."""
HAS_WORKER_INIT_HOOK = hasattr(KVConnectorBase_V1, "initialize_worker_connector")
"""Whether the installed vLLM calls ``initialize_worker_connector(WorkerConnectorInitialization
Data(model=...))`` on worker connectors (the form PR 37339 ended with). With neither hook the
RoPE layout comes from the model's config alone; vLLM 0.32.0 has neither."""


def _worker_init_response() -> Any:
    """vLLM's ``WorkerConnectorInitializationResponse()`` where it exists, else None."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    cls = getattr(base, "WorkerConnectorInitializationResponse", None)
    return None if cls is None else cls()


class SemBlendConnector(KVConnectorBase_V1):
    """vLLM KV connector that reuses an earlier request's KV for aligned, token-identical spans.

    Modes (``kv_connector_extra_config["mode"]``): ``discovery_only`` (default; lookups and
    telemetry, always ``(0, False)``), ``exact_prefix`` and ``request_only_experimental``
    (docs/vllm.md). vLLM calls the scheduler methods on its scheduler thread and the worker methods
    on each worker; no method raises into vLLM after construction.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None)
        self.settings = settings_from_extra_config(extra)
        version = installed_vllm_version()
        if version is None or not SUPPORTED_VLLM.contains(version, prereleases=True):
            logger.warning(
                "semblend: vLLM %s is untested with this connector (tested: %s)",
                version,
                SUPPORTED_VLLM,
            )
        check_engine_settings(self.settings, vllm_config)
        cache_config = vllm_config.cache_config
        self.block_size = int(cache_config.block_size)
        self.errors: dict[str, int] = {}
        self._failures = OnceLog(logger, "continuing without it")
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        model_config = getattr(vllm_config, "model_config", None)
        if role == KVConnectorRole.SCHEDULER:
            unsupported = unsupported_reason(vllm_config, kv_cache_config)
            if unsupported is not None and self.settings.materializes:
                logger.warning("semblend: loads disabled: %s (lookups continue)", unsupported)
            self.scheduler_side = SchedulerSide(
                self.settings,
                block_size=self.block_size,
                prefix_caching=bool(cache_config.enable_prefix_caching),
                model=str(getattr(model_config, "served_model_name", None) or "")
                or str(getattr(model_config, "model", "") or ""),
                tokenizer=str(getattr(model_config, "tokenizer", "") or ""),
                unsupported=unsupported,
            )
        else:
            spec, why = rope_spec_for(vllm_config)
            if spec is None and self.settings.materializes:
                logger.warning("semblend: no RoPE spec (%s); loads will be recomputed", why)
            self.worker_side = WorkerSide(
                vllm_config,
                block_size=self.block_size,
                layout=self.settings.kv_cache_layout,
                spec=spec,
                on_error=self._record_error,
            )
        self._reported: dict[str, int] = {}
        """Counter values at the last ``get_kv_connector_stats`` (increments are reported)."""
        hooks = [
            name
            for name, present in (
                ("initialize_worker_connector", HAS_WORKER_INIT_HOOK),
                ("register_model", HAS_MODEL_HOOK),
            )
            if present
        ]
        logger.info(
            "semblend: vLLM connector (%s, mode=%s, model hooks: %s)",
            role.name.lower(),
            self.settings.mode,
            ", ".join(hooks) or "none",
        )

    # ------------------------------------------------------------------ fail-open
    def _guard(self, where: str, default: T, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:
            self._record_error(where, exc)
            return default

    def _record_error(self, where: str, exc: BaseException) -> None:
        """Count an error in semblend's path; log it once per (where, exception type)."""
        self.errors[where] = self.errors.get(where, 0) + 1
        self._failures.log(where, exc)

    # ------------------------------------------------------------------ scheduler side
    @property
    def requires_kv_delivery(self) -> bool:
        """Nothing is handed off: a dropped load is recomputed, never awaited."""
        return False

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Keep vLLM's BlockPool: donors and load jobs hold block references in it."""
        if self.scheduler_side is not None:
            self._guard("bind_pool", None, self.scheduler_side.bind_pool, gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` this connector will load (synchronously).
        Changes no vLLM state; the provider caches its first decision per request."""
        side = self.scheduler_side
        if side is None:
            return 0, False
        choice = self._guard("lookup", None, side.choose, request, num_computed_tokens)
        return (0 if choice is None else choice.num_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Queue the load job for the allocated blocks (or settle a declined plan)."""
        if self.scheduler_side is not None:
            self._guard(
                "after_alloc",
                None,
                self.scheduler_side.after_alloc,
                request,
                blocks,
                num_external_tokens,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's load jobs (small, picklable)."""
        side = self.scheduler_side
        if side is None:
            return SemBlendConnectorMetadata()
        return side.build_meta()

    def has_pending_block_frees(self) -> bool:
        """vLLM asks this when a running request cannot get blocks, before it preempts one:
        the scheduler side returns donor blocks (least recently registered first) and answers
        True when that freed blocks, so vLLM retries next step instead of preempting."""
        side = self.scheduler_side
        if side is None:
            return False
        return self._guard("relieve_pressure", False, side.relieve_pressure)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Return the request's leases and, unless it received donor KV, keep its computed
        prompt blocks as a donor. Never delays freeing; no transfer params."""
        if self.scheduler_side is not None:
            self._guard("request_finished", None, self.scheduler_side.finished, request, block_ids)
        return False, None

    def snapshot(self) -> dict[str, Any]:
        """Provider telemetry plus donor and error counts (scheduler side) or load counts
        (worker side)."""
        if self.scheduler_side is not None:
            snap = self.scheduler_side.provider.snapshot()
            snap["held_donors"] = self.scheduler_side.donors
            snap["held_donor_blocks"] = self.scheduler_side.pinned_blocks
        else:
            assert self.worker_side is not None
            snap = {
                "loaded_tokens": self.worker_side.loaded_tokens,
                "failed_loads": self.worker_side.failed_jobs,
            }
        snap["connector_errors"] = dict(self.errors)
        return snap

    # ------------------------------------------------------------------ metrics
    def counters(self) -> dict[str, int]:
        """Cumulative counters of this instance, keyed as :mod:`.stats` payloads: outcomes,
        declined reasons, lookups, reused tokens and released donors (scheduler side), loaded
        tokens and failed loads (worker side), and connector errors (both)."""
        out: dict[str, int] = {"connector_errors": sum(self.errors.values())}
        if self.scheduler_side is not None:
            snap = self.scheduler_side.provider.telemetry.snapshot()
            out["lookups"] = int(snap["lookups"])
            out["reused_tokens"] = int(snap["reused_tokens"])
            out["released_donors"] = self.scheduler_side.released_donors
            for outcome, n in snap["outcomes"].items():
                out[OUTCOME_PREFIX + outcome] = int(n)
            for reason, n in snap["declined"].items():
                out[DECLINED_PREFIX + reason] = int(n)
        if self.worker_side is not None:
            out["loaded_tokens"] = self.worker_side.loaded_tokens
            out["failed_loads"] = self.worker_side.failed_jobs
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counter increments since the last call (vLLM calls it every step on the scheduler
        and after every forward on each worker, and ships the sum to its Prometheus metrics).
        None when nothing changed."""
        try:
            now = self.counters()
        except Exception as exc:
            self._record_error("stats", exc)
            return None
        delta = counter_deltas(now, self._reported)
        self._reported = now
        return SemBlendKVConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """vLLM rebuilds the stats object from its payload in the front-end process."""
        return SemBlendKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """The ``vllm:semblend_*`` counters on vLLM's /metrics (:mod:`.stats`)."""
        return SemBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the worker's per-layer cache tensors."""
        if self.worker_side is not None:
            self._guard("register_kv_caches", None, self.worker_side.register, kv_caches)

    def initialize_worker_connector(self, initialization_data: Any) -> Any:
        """The worker hook vLLM PR 37339 ended with (called only by a vLLM that has it, after
        the model is loaded): ``initialization_data.model`` is the live model, whose rotary
        module gives the RoPE layout (:meth:`register_model`). Returns vLLM's
        ``WorkerConnectorInitializationResponse()`` where it exists, else None. Never raises."""
        model = getattr(initialization_data, "model", None)
        if model is not None:
            self.register_model(model)
        return self._guard("initialize_worker_connector", None, _worker_init_response)

    def register_model(self, model: torch.nn.Module) -> None:
        """The first form of PR 37339's hook (called only by a vLLM that has it): take the
        rotary layout (NeoX or GPT-J) from the model's first rotary module (a module with a
        bool ``is_neox_style`` and a ``rotary_dim``). Never raises."""
        if self.worker_side is None:
            return
        side = self.worker_side

        def work() -> None:
            for module in model.modules():
                neox = getattr(module, "is_neox_style", None)
                if isinstance(neox, bool) and hasattr(module, "rotary_dim"):
                    if side.spec is None or neox != side.spec.is_neox_style:
                        side.set_rope_spec(
                            RopeSpec.from_hf_config(
                                self._vllm_config.model_config.hf_config, is_neox_style=neox
                            )
                        )
                    side.model_hook_seen = True
                    return

        self._guard("register_model", None, work)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run this step's load jobs before the forward."""
        if self.worker_side is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, SemBlendConnectorMetadata) and meta.loads:
            self._guard("start_load_kv", None, self.worker_side.load, meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in start_load_kv: nothing to wait for."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing is saved: donors stay in vLLM's own blocks."""

    def wait_for_save(self) -> None:
        """Nothing is saved."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Target blocks of this step's failed loads (vLLM recomputes them)."""
        if self.worker_side is None:
            return set()
        return self.worker_side.take_failed_blocks()

    def shutdown(self) -> None:
        """Return every block reference the scheduler side holds."""
        if self.scheduler_side is not None and self.scheduler_side.pool is not None:
            self._guard("shutdown", None, self.scheduler_side.release_all)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Any layout: the worker reads the attention backend's own."""
        return None
