"""Telemetry: semblend_* series on a private registry, snapshot, one outcome per request."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from semblend_sglang.config import Config
from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace
from semblend_sglang.provider import SemanticProvider
from semblend_sglang.telemetry import OUTCOMES, Telemetry

NS = Namespace("SmolLM2-135M-Instruct")


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def test_series_and_snapshot() -> None:
    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    telemetry.record_outcome("exact")
    telemetry.record_outcome("materialized", reused=1200)
    telemetry.record_outcome("declined", reason="no_donor")
    telemetry.record_outcome("declined", reason="something-new")
    telemetry.record_outcome("cold_fallback")
    telemetry.observe_lookup(0.002)
    telemetry.observe_hook(0.003)
    telemetry.observe_hook(0.001)
    telemetry.set_donors(7)
    assert sample(registry, "semblend_requests_total", outcome="exact") == 1
    assert sample(registry, "semblend_requests_total", outcome="declined") == 2
    assert sample(registry, "semblend_declined_total", reason="no_donor") == 1
    assert sample(registry, "semblend_declined_total", reason="other") == 1
    assert sample(registry, "semblend_reused_tokens_total") == 1200
    assert sample(registry, "semblend_lookup_seconds_count") == 1
    assert sample(registry, "semblend_donors") == 7
    assert sample(registry, "semblend_hook_seconds_total") == pytest.approx(0.004)
    text = generate_latest(registry).decode()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert line.startswith("semblend_")
    snap = telemetry.snapshot()
    assert snap["outcomes"] == {
        "exact": 1,
        "discovery_only": 0,
        "materialized": 1,
        "declined": 2,
        "cold_fallback": 1,
    }
    assert snap["declined"] == {"no_donor": 1, "other": 1}
    assert snap["requests"] == 5 and snap["reused_tokens"] == 1200 and snap["donors"] == 7
    assert snap["hook_calls"] == 2 and snap["hook_seconds"] == pytest.approx(0.004)
    with pytest.raises(ValueError):
        telemetry.record_outcome("hit")


def test_two_telemetries_share_one_registry() -> None:
    registry = CollectorRegistry()
    a, b = Telemetry(registry), Telemetry(registry)
    a.record_outcome("exact")
    b.record_outcome("exact")
    assert sample(registry, "semblend_requests_total", outcome="exact") == 2
    assert a.snapshot()["requests"] == 1


@pytest.fixture(scope="module")
def essay_ids(smollm2_tokenizer: Any, essay_texts: list[str]) -> np.ndarray:
    ids = [smollm2_tokenizer(t, add_special_tokens=False)["input_ids"] for t in essay_texts]
    return np.asarray([tok for part in ids for tok in part], dtype=np.int64)


def test_exactly_one_outcome_per_request(essay_ids: np.ndarray) -> None:
    registry = CollectorRegistry()
    calls = {"n": 0}

    def source(handle: Any) -> np.ndarray | None:
        calls["n"] += 1
        if handle == "boom":
            raise RuntimeError("engine exploded")
        return essay_ids[:3000]

    provider = SemanticProvider(Config(), source, registry=registry)
    provider.register(NS, "d", essay_ids[:3000])
    shifted = np.concatenate([essay_ids[40000:40100], essay_ids[:3000]])

    # exact route, decided once however often the engine asks
    for _ in range(5):
        assert provider.lookup(LookupParams(NS, essay_ids[:3000], 2900, "r-exact")).kind == "exact"
    # decline
    assert (
        provider.lookup(LookupParams(NS, essay_ids[20000:21000], 0, "r-miss")).reason == "no_donor"
    )
    # plan -> materialized (a second report is ignored)
    assert provider.lookup(LookupParams(NS, shifted, 0, "r-hit")).kind == "plan"
    assert provider.lookup(LookupParams(NS, shifted, 0, "r-hit")).kind == "plan"
    assert provider.record_materialized("r-hit", 2900) is True
    assert provider.record_materialized("r-hit", 2900) is False
    assert provider.record_declined("r-hit") is False
    # plan -> engine declined
    assert provider.lookup(LookupParams(NS, shifted, 0, "r-engine-no")).kind == "plan"
    assert provider.record_declined("r-engine-no", "engine_declined")
    # plan never reported -> counted as unreported when released
    assert provider.lookup(LookupParams(NS, shifted, 0, "r-silent")).kind == "plan"
    provider.release("r-silent")
    provider.release("r-silent")
    # plan -> engine failed
    assert provider.lookup(LookupParams(NS, shifted, 0, "r-fail")).kind == "plan"
    assert provider.record_cold_fallback("r-fail", "materialize")
    # internal error -> cold_fallback, nothing raised
    provider.register(NS, "boom", essay_ids[60000:63000])
    bad = np.concatenate([essay_ids[41000:41100], essay_ids[60000:63000]])
    decision = provider.lookup(LookupParams(NS, bad, 0, "r-error"))
    assert decision.kind == "decline" and decision.reason == "cold_fallback"
    # no request id: uncached, one outcome per call
    provider.lookup(LookupParams(NS, essay_ids[:100], 0, None))
    # outcome reports for unknown requests change nothing
    assert provider.record_materialized("nobody", 5) is False

    snap = provider.snapshot()
    assert snap["outcomes"] == {
        "exact": 1,
        "discovery_only": 0,
        "materialized": 1,
        "declined": 4,
        "cold_fallback": 2,
    }
    assert snap["declined"] == {
        "engine_declined": 1,
        "no_donor": 1,
        "prompt_too_short": 1,
        "unreported": 1,
    }
    assert snap["requests"] == 8
    assert snap["reused_tokens"] == 2900
    assert snap["errors"] == {"lookup": 1, "materialize": 1}
    assert snap["pending_plans"] == 0
    assert sample(registry, "semblend_requests_total", outcome="cold_fallback") == 2
    assert set(snap["outcomes"]) == set(OUTCOMES)
