"""One decision per request id, and exactly one recorded outcome per request.

:class:`RequestDecisions` is the provider's memory of what it told the engine: the first
:class:`~semblend_sglang.plan.Decision` for a request id is kept until the request ends, so the
engine may ask at every scheduling step for the cost of a dict lookup. Exact and decline decisions
are final and recorded at once; a plan stays pending until the engine reports what it did with it
(materialized, declined, cold fallback) or the request ends unreported. The number of kept
decisions is bounded: the oldest goes first, and a pending plan that goes that way is counted as
declined (``unreported``). Thread-safe (one lock); never calls back into the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from .plan import Decision, Reason
from .telemetry import Telemetry

MAX_CACHED_REQUESTS = 65536
"""Default bound of kept decisions."""


class RequestDecisions:
    """Kept decisions by request id, the pending plans among them, and their outcomes."""

    def __init__(self, telemetry: Telemetry, max_cached: int = MAX_CACHED_REQUESTS) -> None:
        self.telemetry = telemetry
        self._max_cached = max(1, max_cached)
        self._lock = threading.Lock()
        self._decisions: dict[Hashable, Decision] = {}
        self._pending: dict[Hashable, Decision] = {}

    def get(self, request_id: Hashable) -> Decision | None:
        """The kept decision of ``request_id``, or None."""
        return self._decisions.get(request_id)

    def keep(self, request_id: Hashable, decision: Decision) -> Decision:
        """Keep ``decision`` as ``request_id``'s and return it; when another thread kept one
        first, return that one instead (nothing recorded). A final decision's outcome is
        recorded here; a plan becomes pending."""
        with self._lock:
            kept = self._decisions.get(request_id)
            if kept is not None:
                return kept
            self._decisions[request_id] = decision
            if decision.kind == "plan":
                self._pending[request_id] = decision
            while len(self._decisions) > self._max_cached:
                oldest = next(iter(self._decisions))
                del self._decisions[oldest]
                if self._pending.pop(oldest, None) is not None:
                    self.telemetry.record_outcome("declined", reason=Reason.UNREPORTED)
        if decision.kind != "plan":
            self.record_final(decision)
        return decision

    def record_final(self, decision: Decision) -> None:
        """Record the outcome of an exact or decline decision (no request id kept)."""
        if decision.kind == "exact":
            self.telemetry.record_outcome("exact")
        elif decision.reason == Reason.DISCOVERY_ONLY:
            self.telemetry.record_outcome("discovery_only")
        elif decision.reason == Reason.COLD_FALLBACK:
            self.telemetry.record_outcome("cold_fallback")
        else:
            self.telemetry.record_outcome("declined", reason=decision.reason)

    def release(self, request_id: Hashable) -> None:
        """Forget ``request_id``'s decision; a plan still pending is counted as declined
        (``unreported``)."""
        with self._lock:
            self._decisions.pop(request_id, None)
            pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.telemetry.record_outcome("declined", reason=Reason.UNREPORTED)

    def report(
        self,
        request_id: Hashable,
        outcome: str,
        reason: str | None,
        reused: int,
        spans: int = 0,
        donors: int = 0,
    ) -> bool:
        """Record the engine's ``outcome`` for ``request_id``'s pending plan; False (and nothing
        recorded) when it has none."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is None:
            return False
        self.telemetry.record_outcome(
            outcome, reason=reason, reused=reused, spans=spans, donors=donors
        )
        return True

    def counts(self) -> dict[str, int]:
        """``pending_plans`` and ``cached_decisions``, for the provider's snapshot."""
        with self._lock:
            return {"pending_plans": len(self._pending), "cached_decisions": len(self._decisions)}
