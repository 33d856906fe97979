"""The connector's counters on vLLM's own metrics path (``KVConnectorStats``).

vLLM 0.32 collects ``get_kv_connector_stats()`` from the scheduler-side connector (every
``update_from_output``) and from each worker (in ``KVConnectorOutput``), aggregates them, ships
the ``to_dict()`` payload in ``SchedulerStats`` to the front-end process and hands it to the
connector class's Prometheus metrics (``build_prom_metrics``) there. That front-end process is
the one whose registry ``/metrics`` exports, so these counters reach ``/metrics`` whatever
process the EngineCore runs in. (The ``semblend_*`` series of :mod:`semblend_sglang.telemetry`
are registered in the EngineCore's process instead, which ``vllm serve`` does not export.)

The payload is a flat ``{name: int}`` of increments since the previous report; names are
listed in :data:`COUNTERS` and :data:`LABELLED`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

OUTCOME_PREFIX = "outcome:"
"""Payload keys ``outcome:<name>``: requests settled with that outcome (exact, discovery_only,
materialized, declined, cold_fallback)."""
DECLINED_PREFIX = "declined:"
"""Payload keys ``declined:<reason>``: declined requests by reason (plan.Reason values)."""

COUNTERS: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:semblend_lookups", "Donor lookups made by the SemBlend connector."),
    "reused_tokens": (
        "vllm:semblend_reused_tokens",
        "Prompt tokens whose KV the SemBlend connector planned to load from a donor.",
    ),
    "loaded_tokens": (
        "vllm:semblend_loaded_tokens",
        "Prompt tokens whose donor KV the SemBlend workers copied into a request's blocks.",
    ),
    "failed_loads": (
        "vllm:semblend_failed_loads",
        "SemBlend load jobs that failed on a worker (vLLM recomputed their blocks).",
    ),
    "connector_errors": (
        "vllm:semblend_connector_errors",
        "Errors inside the SemBlend connector (each answered by falling back to a prefill).",
    ),
    "released_donors": (
        "vllm:semblend_released_donors",
        "Donors whose blocks the SemBlend connector returned to vLLM (budget or memory pressure).",
    ),
}
"""Plain payload keys -> (Prometheus counter name, help)."""

LABELLED: dict[str, tuple[str, str, str]] = {
    OUTCOME_PREFIX: (
        "vllm:semblend_requests",
        "outcome",
        "Requests the SemBlend connector looked up, by outcome.",
    ),
    DECLINED_PREFIX: (
        "vllm:semblend_declined",
        "reason",
        "Requests whose semantic reuse was declined, by reason.",
    ),
}
"""Payload key prefixes -> (Prometheus counter name, extra label, help)."""


def counter_deltas(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The non-zero increments of ``now`` over ``before`` (missing keys count as 0)."""
    out = {}
    for key, value in now.items():
        delta = int(value) - int(before.get(key, 0))
        if delta:
            out[key] = delta
    return out


@dataclass
class SemBlendKVConnectorStats(KVConnectorStats):
    """Counter increments of one reporting interval: ``data`` maps payload keys to ints.
    ``aggregate`` adds them (scheduler plus workers, and intervals); ``reduce`` returns them."""

    def reset(self) -> None:
        """Clear the counts."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counts into this object (returns it)."""
        for key, value in (other.data or {}).items():
            if isinstance(value, int | float):
                self.data[key] = self.data.get(key, 0) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's counts, for vLLM's periodic log line."""
        return {k: v for k, v in sorted(self.data.items()) if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.values())


class SemBlendPromMetrics(KVConnectorPromMetrics):
    """Registers the ``vllm:semblend_*`` counters (with vLLM's per-engine labels) in the
    front-end's Prometheus registry and adds each reported payload to them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._plain: dict[str, dict[int, Any]] = {}
        for key, (name, help_) in COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=help_, labelnames=labelnames)
            self._plain[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self._labelled: dict[str, Any] = {
            prefix: self._counter_cls(
                name=name, documentation=help_, labelnames=[*labelnames, label]
            )
            for prefix, (name, label, help_) in LABELLED.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one payload (``SemBlendKVConnectorStats.to_dict()``) to the counters of engine
        ``engine_idx``; unknown keys and non-positive values are ignored."""
        values = self.per_engine_labelvalues.get(engine_idx)
        if values is None:
            return
        for key, amount in (transfer_stats_data or {}).items():
            if not isinstance(amount, int | float) or amount <= 0:
                continue
            if key in self._plain:
                self._plain[key][engine_idx].inc(amount)
                continue
            for prefix, counter in self._labelled.items():
                if key.startswith(prefix):
                    counter.labels(*values, key[len(prefix) :]).inc(amount)
                    break
