"""Telemetry: exactly one outcome per request, as ``semblend_*`` Prometheus series and a snapshot.

Outcomes: exact, discovery_only, materialized (with reused tokens), declined (with a reason from
:class:`semblend_sglang.plan.Reason`), cold_fallback. Also a lookup-latency histogram, a donor
gauge, error counts, and the time spent in the engine's hooks (what semblend adds to the
scheduler loop). The provider is the only caller of the ``record_*`` methods; it enforces
"one outcome per request". Latency is measured for reporting only and never feeds a decision.
Works without prometheus_client (the snapshot still counts).
"""

from __future__ import annotations

import threading
from typing import Any

from .plan import Reason

OUTCOMES = ("exact", "discovery_only", "materialized", "declined", "cold_fallback")

SERIES = {
    "requests": "semblend_requests_total",
    "declined": "semblend_declined_total",
    "reused_tokens": "semblend_reused_tokens_total",
    "reused_spans": "semblend_reused_spans_total",
    "reused_donors": "semblend_reused_donors_total",
    "recomputed_tokens": "semblend_recomputed_tokens_total",
    "lookup_seconds": "semblend_lookup_seconds",
    "hook_seconds": "semblend_hook_seconds",
    "copy_seconds": "semblend_copy_seconds",
    "donors": "semblend_donors",
    "errors": "semblend_errors_total",
    "similarity": "semblend_discovery_similarity",
}
"""Prometheus series names (counters are exposed with the ``_total`` suffix shown)."""

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1, 1.0)

_COPY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

_shared_lock = threading.Lock()
_shared_metrics: dict[int, dict[str, Any]] = {}


def _metrics_for(registry: Any) -> dict[str, Any] | None:
    """The semblend collectors registered on ``registry`` (created once per registry)."""
    try:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    except ImportError:
        return None
    reg = REGISTRY if registry is None else registry
    with _shared_lock:
        found = _shared_metrics.get(id(reg))
        if found is not None and found["registry"] is reg:
            return found
        metrics = {
            "registry": reg,
            "requests": Counter(
                "semblend_requests",
                "Requests by outcome (exactly one outcome per request).",
                ["outcome"],
                registry=reg,
            ),
            "declined": Counter(
                "semblend_declined",
                "Declined requests by reason.",
                ["reason"],
                registry=reg,
            ),
            "reused_tokens": Counter(
                "semblend_reused_tokens",
                "Prompt tokens whose KV was materialized from a donor.",
                registry=reg,
            ),
            "reused_spans": Counter(
                "semblend_reused_spans",
                "Spans materialized (a materialized request counts each of its spans).",
                registry=reg,
            ),
            "reused_donors": Counter(
                "semblend_reused_donors",
                "Donors used (a materialized request counts each distinct donor it read).",
                registry=reg,
            ),
            "recomputed_tokens": Counter(
                "semblend_recomputed_tokens",
                "Reused positions recomputed instead of read from the donor (recompute budget, "
                "quality gate).",
                registry=reg,
            ),
            "lookup_seconds": Histogram(
                "semblend_lookup_seconds",
                "Provider lookup latency (first lookup of a request).",
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ),
            "hook_seconds": Counter(
                "semblend_hook_seconds",
                "Time spent in semblend code inside the engine's hooks (lookups included).",
                registry=reg,
            ),
            "copy_seconds": Histogram(
                "semblend_copy_seconds",
                "Donor K/V copy time per prefill batch (gather, RoPE rotation and scatter of "
                "every span the batch reuses; the device is synchronized before it ends).",
                buckets=_COPY_BUCKETS,
                registry=reg,
            ),
            "donors": Gauge(
                "semblend_donors",
                "Donors in the index.",
                registry=reg,
                multiprocess_mode="livesum",
            ),
            "errors": Counter(
                "semblend_errors",
                "Internal errors turned into cold fallbacks, by where they happened.",
                ["where"],
                registry=reg,
            ),
            "similarity": Histogram(
                "semblend_discovery_similarity",
                "Embedding similarity of the best donor (discovery/substitute).",
                buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
                registry=reg,
            ),
        }
        # The closed label sets start at 0, so that every outcome and reason is a series from
        # the first scrape (rates and dashboards need no first event; in SGLang's multiprocess
        # registry a label value that was never written is not exported at all).
        for outcome in OUTCOMES:
            metrics["requests"].labels(outcome=outcome)
        for reason in sorted(_REASONS):
            metrics["declined"].labels(reason=reason)
        _shared_metrics[id(reg)] = metrics
        return metrics


_REASONS = frozenset(r.value for r in Reason)
"""Every reason's value (a known telemetry label)."""


class Telemetry:
    """Counts outcomes for one provider; exports them on a prometheus registry.

    ``registry``: a ``prometheus_client.CollectorRegistry`` (None: the global default registry).
    Several Telemetry objects on one registry share its series; each keeps its own snapshot.
    Thread-safe.
    """

    def __init__(self, registry: Any = None) -> None:
        self._metrics = _metrics_for(registry)
        self._lock = threading.Lock()
        self._outcomes = dict.fromkeys(OUTCOMES, 0)
        self._declined: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._reused_tokens = 0
        self._reused_spans = 0
        self._reused_donors = 0
        self._multi_donor_requests = 0
        self._recomputed_tokens = 0
        self._lookups = 0
        self._lookup_seconds = 0.0
        self._hook_calls = 0
        self._hook_seconds = 0.0
        self._copies = 0
        self._copy_seconds = 0.0
        self._donors = 0

    def record_outcome(
        self,
        outcome: str,
        *,
        reason: str | None = None,
        reused: int = 0,
        spans: int = 0,
        donors: int = 0,
    ) -> None:
        """Count one request's outcome. ``reason`` (declined only) outside :class:`Reason`
        is counted as ``other``; ``reused``, ``spans`` and ``donors`` (materialized only) add
        the request's reused tokens, spans and distinct donors."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        label = None
        if outcome == "declined":
            label = reason if reason in _REASONS else Reason.OTHER
        with self._lock:
            self._outcomes[outcome] += 1
            if label is not None:
                self._declined[label] = self._declined.get(label, 0) + 1
            if outcome == "materialized":
                self._reused_tokens += int(reused)
                self._reused_spans += int(spans)
                self._reused_donors += int(donors)
                self._multi_donor_requests += int(donors > 1)
        if self._metrics is not None:
            self._metrics["requests"].labels(outcome=outcome).inc()
            if label is not None:
                self._metrics["declined"].labels(reason=label).inc()
            if outcome == "materialized" and reused:
                self._metrics["reused_tokens"].inc(int(reused))
                self._metrics["reused_spans"].inc(int(spans))
                self._metrics["reused_donors"].inc(int(donors))

    def observe_recomputed(self, tokens: int) -> None:
        """Count ``tokens`` reused positions recomputed (the engine adapter, per chunk)."""
        with self._lock:
            self._recomputed_tokens += int(tokens)
        if self._metrics is not None and tokens:
            self._metrics["recomputed_tokens"].inc(int(tokens))

    def observe_lookup(self, seconds: float) -> None:
        """Record one (uncached) lookup's latency."""
        with self._lock:
            self._lookups += 1
            self._lookup_seconds += seconds
        if self._metrics is not None:
            self._metrics["lookup_seconds"].observe(seconds)

    def observe_hook(self, seconds: float) -> None:
        """Record the time one engine hook spent in semblend code (the engine's own work
        excluded). Called by the engine adapter for every hook call on the request path."""
        with self._lock:
            self._hook_calls += 1
            self._hook_seconds += seconds
        if self._metrics is not None:
            self._metrics["hook_seconds"].inc(seconds)

    def observe_copy(self, seconds: float) -> None:
        """Record one prefill batch's donor K/V copy (the engine adapter, after the copy's
        device work finished)."""
        with self._lock:
            self._copies += 1
            self._copy_seconds += seconds
        if self._metrics is not None:
            self._metrics["copy_seconds"].observe(seconds)

    def observe_similarity(self, value: float) -> None:
        """Record the embedding similarity of a discovered donor."""
        if self._metrics is not None:
            self._metrics["similarity"].observe(value)

    def record_error(self, where: str) -> None:
        """Count an internal error (the request itself gets a cold_fallback outcome)."""
        with self._lock:
            self._errors[where] = self._errors.get(where, 0) + 1
        if self._metrics is not None:
            self._metrics["errors"].labels(where=where).inc()

    def set_donors(self, count: int) -> None:
        """Set the donor gauge."""
        with self._lock:
            self._donors = count
        if self._metrics is not None:
            self._metrics["donors"].set(count)

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict copy of this object's counts: outcomes, declined reasons, reused tokens,
        spans and donors (and requests that read more than one donor), recomputed tokens,
        lookups, mean lookup milliseconds, hook calls and seconds, batch copies and their seconds,
        donors, errors."""
        with self._lock:
            return {
                "outcomes": dict(self._outcomes),
                "declined": dict(sorted(self._declined.items())),
                "reused_tokens": self._reused_tokens,
                "reused_spans": self._reused_spans,
                "reused_donors": self._reused_donors,
                "multi_donor_requests": self._multi_donor_requests,
                "recomputed_tokens": self._recomputed_tokens,
                "requests": sum(self._outcomes.values()),
                "lookups": self._lookups,
                "lookup_ms_mean": (1000.0 * self._lookup_seconds / self._lookups)
                if self._lookups
                else 0.0,
                "hook_calls": self._hook_calls,
                "hook_seconds": self._hook_seconds,
                "copies": self._copies,
                "copy_seconds": self._copy_seconds,
                "donors": self._donors,
                "errors": dict(sorted(self._errors.items())),
            }
