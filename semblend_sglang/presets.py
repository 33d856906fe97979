"""The setting groups: the repair settings a request may choose, the named presets of them,
and the settings that tune the mechanism.

A *preset* is a named set of values for some of :data:`REPAIR_SETTINGS`; the others keep their
defaults. The server takes one with ``--semblend-preset`` / ``SEMBLEND_PRESET`` (a preset fills
the repair settings that no source sets), a request with ``custom_params.semblend_reuse =
{"preset": NAME}`` (:mod:`semblend_sglang.request_settings`). The figures behind each preset
are in docs/perf.md ("the repair").
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

REPAIR_SETTINGS: tuple[str, ...] = (
    "recompute_strategy",
    "recompute_ratio",
    "recompute_recheck_depth",
    "recompute_recheck_width",
    "recompute_check_share",
    "recompute_check_max_spans",
    "recompute_check_span_limit",
    "recompute_min_deviation",
    "quality_gate",
)
"""The :class:`~semblend_sglang.config.Config` fields one request may set for itself: how its
reused KV is repaired. Everything else (the check layer included: the model's layers are
wrapped once) is the server's."""

PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # the defaults: plans of several spans checked twice (keeps the most answers)
        "quality": MappingProxyType({}),
        # one check: about twice as fast on multi-span plans at 8K, loses answers there
        "fast": MappingProxyType({"recompute_recheck_depth": 0.0}),
    }
)
"""Preset name -> the repair settings it sets (the rest are their defaults)."""

DEFAULT_PRESET = "quality"

TUNING_SETTINGS = frozenset(
    {
        "strict_prefix_boundary",
        "max_plan_donors",
        "exact_sufficient_ratio",
        "min_reuse_tokens",
        "min_reuse_ratio",
        "sink_tokens",
        "recompute_check_layer",
        "recompute_recheck_depth",
        "recompute_recheck_width",
        "recompute_check_share",
        "recompute_check_max_spans",
        "recompute_check_span_limit",
        "recompute_min_deviation",
        "quality_gate",
        "sparse_path",
        "max_spans",
        "min_span_tokens",
        "max_candidates",
        "lookup_budget_ms",
        "min_candidate_tokens",
        "chunk_avg_tokens",
        "embed_discovery",
        "dispatch_load_margin",
        "dispatch_index_bytes",
        "dispatch_chunk_avg_tokens",
        "dispatch_expire_ratio",
    }
)
"""The settings that tune the mechanism (``FieldSpec.tuning``): the settings table lists them
apart from the ones a user sets; a preset or a request's repair settings cover the repair's."""
