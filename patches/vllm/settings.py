"""The connector's settings: vLLM's ``kv_connector_extra_config`` over SEMBLEND_* variables.

The connector modes (the names of the ``semblend-vllm-connector`` package, whose PyPI description
documents its ``kv_connector_extra_config``) map onto the shared
:class:`~semblend_sglang.config.Config`:

========================== ============================ =================================
connector ``mode``         provider mode                what the connector does
========================== ============================ =================================
``discovery_only``         ``discovery_only``           lookups and telemetry; never loads
``exact_prefix``           ``exact_spans``, 0 sinks     loads a token-identical span that
                                                        starts at vLLM's computed boundary
``request_only_experimental`` ``substitute``            loads the donor's block-aligned
                                                        prefix run (tokens may differ)
========================== ============================ =================================

That package's other keys (``min_prompt_tokens``, ``min_similarity``, ``min_reuse_ratio``,
``embedder_type``, ``model_id``), and every key of ``Config``, are passed to
``Config.from_sources``. Its ``provider`` key (``local`` or ``semblend``: which backend it ran)
is validated and ignored: both name this package's index, the only provider there is. The
connector's own keys are listed in :data:`CONNECTOR_KEYS`. Bad values raise
:class:`~semblend_sglang.config.ConfigError` naming the key; the connector raises it from its
constructor (start-up), never from a request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from semblend_sglang.config import Config, ConfigError

CONNECTOR_MODES = ("discovery_only", "exact_prefix", "request_only_experimental")
MATERIALIZING_MODES = ("exact_prefix", "request_only_experimental")
KV_LAYOUTS = ("auto", "vllm_packed", "vllm_cpu", "vllm_cpu_kt")

_PROVIDER_MODE = {
    "discovery_only": "discovery_only",
    "exact_prefix": "exact_spans",
    "request_only_experimental": "substitute",
}

CONNECTOR_KEYS = ("mode", "donor_block_fraction", "kv_cache_layout", "provider")
"""``kv_connector_extra_config`` keys the connector reads itself (all others go to Config)."""

PROVIDERS = ("local", "semblend")
"""Accepted values of the ``provider`` key (both mean this package's index; the key is
otherwise ignored)."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """Validated settings of one connector instance.

    ``mode``: one of :data:`CONNECTOR_MODES`. ``config``: the provider's Config (its ``mode`` is
    the provider mode of the table above). ``donor_block_fraction``: at most this fraction of
    vLLM's KV blocks is held for donors. ``kv_cache_layout``: how the worker reads vLLM's
    per-layer cache tensors (``auto``: from the attention backend).
    """

    mode: str
    config: Config
    donor_block_fraction: float = 0.25
    kv_cache_layout: str = "auto"

    @property
    def materializes(self) -> bool:
        """True when the mode may report matched tokens to vLLM."""
        return self.mode in MATERIALIZING_MODES


def settings_from_extra_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Build :class:`ConnectorSettings` from ``kv_connector_extra_config`` (highest precedence)
    over ``environ`` (``os.environ`` when None) over defaults. Raises ConfigError."""
    extra = {} if extra is None else extra
    if not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config", extra, "a JSON object")
    environ = os.environ if environ is None else environ
    mode = extra.get("mode", "discovery_only")
    if mode not in CONNECTOR_MODES:
        raise ConfigError("mode", mode, "one of " + ", ".join(CONNECTOR_MODES))
    if extra.get("discovery_only") is True and mode != "discovery_only":
        raise ConfigError("discovery_only", True, f"false together with mode={mode!r}")
    fraction = extra.get("donor_block_fraction", 0.25)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, int | float)
        or not 0.0 < float(fraction) <= 0.9
    ):
        raise ConfigError("donor_block_fraction", fraction, "a number in (0, 0.9]")
    provider = extra.get("provider", "local")
    if provider not in PROVIDERS:
        raise ConfigError("provider", provider, "one of " + ", ".join(PROVIDERS))
    layout = extra.get("kv_cache_layout", "auto")
    if layout not in KV_LAYOUTS:
        raise ConfigError("kv_cache_layout", layout, "one of " + ", ".join(KV_LAYOUTS))
    rest = {k: v for k, v in extra.items() if k not in CONNECTOR_KEYS and k != "discovery_only"}
    env = {
        k: v for k, v in environ.items() if k not in ("SEMBLEND_MODE", "SEMBLEND_DISCOVERY_ONLY")
    }
    base = Config.from_sources(env=env, json_obj=rest)
    overrides: dict[str, Any] = {"mode": _PROVIDER_MODE[mode]}
    if mode == "exact_prefix":
        # vLLM loads a prefix: nothing can be recomputed between the boundary and the span, so
        # there are no sink tokens, and the span at the boundary must survive the planner's
        # span limit (the connector picks it; see scheduler_side).
        # One donor per plan: vLLM loads a run of one donor's blocks.
        overrides.update(sink_tokens=0, strict_prefix_boundary=False, max_plan_donors=1)
    elif mode == "request_only_experimental":
        overrides.update(
            sink_tokens=0,
            strict_prefix_boundary=False,
            exact_materialization_only=False,
            max_plan_donors=1,
        )
    return ConnectorSettings(
        mode=mode,
        config=replace(base, **overrides),
        donor_block_fraction=float(fraction),
        kv_cache_layout=layout,
    )
