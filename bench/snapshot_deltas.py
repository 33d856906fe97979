"""What one request changed in semblend's counters: differences of two ``GET /semblend/snapshot``
totals read around it (the e2e runner and the scripts that time single requests read them)."""

from __future__ import annotations

from typing import Any


def ms_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, key: str) -> float | None:
    """Milliseconds the seconds counter ``key`` grew between two ``/semblend/snapshot`` totals
    (``hook_seconds``: the schedulers' time in semblend's hooks; ``copy_seconds``: their donor
    K/V copies, part of it); None when either is None (a vanilla server)."""
    if before is None or after is None:
        return None
    return 1000.0 * (float(after.get(key, 0.0)) - float(before.get(key, 0.0)))


def counter_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, key: str) -> int:
    """How much the numeric counter ``key`` grew between two ``/semblend/snapshot`` totals; 0
    when either is None or lacks the key (an older server without that counter)."""
    if before is None or after is None:
        return 0
    return int(after.get(key, 0)) - int(before.get(key, 0))


def residual_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """The mean residual deviation of the check layers run between two ``/semblend/snapshot``
    totals (``recompute_residual_deviation_sum`` over ``recompute_checks``); None when no
    check ran or a snapshot is None."""
    checks = counter_delta(before, after, "recompute_checks")
    if checks <= 0 or before is None or after is None:
        return None
    key = "recompute_residual_deviation_sum"
    return (float(after.get(key, 0.0)) - float(before.get(key, 0.0))) / checks


def declined_reasons(outcome: str | None) -> frozenset[str]:
    """The decline reasons of an :func:`outcome_delta` outcome (``declined:a,b`` -> {a, b});
    empty for any other outcome or None."""
    if not outcome or not outcome.startswith("declined:"):
        return frozenset()
    return frozenset(r for r in outcome[len("declined:") :].split(",") if r)


def outcome_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> tuple[str, int]:
    """The outcome a request added to the counters between two ``/semblend/snapshot`` totals
    (``materialized``, ``declined:<reasons>``, several joined by commas; ``none`` when no count
    changed, ``unknown`` when either snapshot is None), and the tokens reused meanwhile."""
    if before is None or after is None:
        return "unknown", 0
    changed = [
        name
        for name, count in (after.get("outcomes") or {}).items()
        if count != (before.get("outcomes") or {}).get(name, 0)
    ]
    reused = counter_delta(before, after, "reused_tokens")
    if not changed:
        return "none", reused
    if "declined" in changed:
        reasons = {
            r
            for r, n in (after.get("declined") or {}).items()
            if n != (before.get("declined") or {}).get(r, 0)
        }
        return "declined:" + ",".join(sorted(reasons)), reused
    return ",".join(sorted(changed)), reused
