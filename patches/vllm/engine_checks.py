"""What the vLLM engine's configuration allows the connector: checked once, at start-up.

Called only by :class:`~.connector.SemBlendConnector`'s constructor. :func:`check_engine_settings`
raises (a configuration error stops the engine's start); the other two answer why not instead
of raising, so the connector can start and decline every load with that reason.
"""

from __future__ import annotations

from typing import Any

from semblend_sglang.config import ConfigError
from semblend_sglang.kernels import RopeSpec

from .settings import ConnectorSettings


def check_engine_settings(settings: ConnectorSettings, vllm_config: Any) -> None:
    """Raise ConfigError for engine settings a materializing mode cannot run safely with."""
    if not settings.materializes:
        return
    kv = vllm_config.kv_transfer_config
    policy = getattr(kv, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise ConfigError(
            "kv_load_failure_policy",
            policy,
            f"'recompute' with mode={settings.mode!r} (a failed semantic load must fall back to "
            "a normal prefill, not fail the request)",
        )
    if (
        settings.mode == "request_only_experimental"
        and vllm_config.cache_config.enable_prefix_caching
    ):
        raise ConfigError(
            "mode",
            settings.mode,
            "a vLLM engine started with --no-enable-prefix-caching (substituted prefixes must "
            "not meet vLLM's exact prefix cache)",
        )


def rope_spec_for(vllm_config: Any) -> tuple[RopeSpec | None, str | None]:
    """The model's RoPE spec from its HF config, or (None, why)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None, "no model config"
    try:
        return RopeSpec.from_hf_config(model_config.hf_config), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def unsupported_reason(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why this engine's KV cache cannot receive donor KV (None: it can). Checked once."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (one full-attention group is supported)"
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
        return f"KV cache spec {type(spec).__name__} (only FullAttentionSpec is supported)"
    head_v = getattr(spec, "head_size_v", None)
    if head_v is not None and head_v != spec.head_size:
        return f"head_size_v {head_v} != head_size {spec.head_size}"
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype not in ("auto", None):
        return f"cache_dtype={cache_dtype!r} (quantized caches are not supported yet)"
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "use_mla", False):
        return "MLA attention"
    return None
