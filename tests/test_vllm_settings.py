"""The vLLM connector's settings (no vLLM needed): mode mapping, precedence and clear errors."""

from __future__ import annotations

import pytest

from semblend_sglang.config import ConfigError
from semblend_sglang.patches.vllm.settings import CONNECTOR_MODES, settings_from_extra_config


def test_default_is_discovery_only() -> None:
    s = settings_from_extra_config({}, environ={})
    assert s.mode == "discovery_only" and not s.materializes
    assert s.config.mode == "discovery_only"
    assert s.donor_block_fraction == 0.25 and s.kv_cache_layout == "auto"


def test_semblend_vllm_connector_keys_reach_the_shared_config() -> None:
    """The keys the semblend-vllm-connector package documents; ``provider`` is accepted and
    ignored."""
    s = settings_from_extra_config(
        {
            "mode": "exact_prefix",
            "provider": "semblend",
            "min_prompt_tokens": 300,
            "min_similarity": 0.7,
            "min_reuse_ratio": 0.5,
            "embedder_type": "jaccard",
            "model_id": "meta-llama/Llama-3.1-8B-Instruct",
        },
        environ={},
    )
    c = s.config
    assert (c.mode, c.min_prompt_tokens, c.unknown_keys) == ("exact_spans", 300, ())
    assert (c.min_similarity, c.min_reuse_ratio, c.embedder) == (0.7, 0.5, "jaccard")
    assert c.model_id == "meta-llama/Llama-3.1-8B-Instruct"
    # vLLM loads a prefix: no sink tokens, and the boundary span must survive the span limit.
    assert c.sink_tokens == 0 and c.strict_prefix_boundary is False
    assert c.max_plan_donors == 1  # vLLM loads one donor's run of blocks


def test_request_only_maps_to_substitute() -> None:
    s = settings_from_extra_config({"mode": "request_only_experimental"}, environ={})
    assert s.materializes and s.config.mode == "substitute"
    assert s.config.exact_materialization_only is False


def test_json_beats_environment_and_semblend_mode_does_not_apply() -> None:
    env = {"SEMBLEND_MIN_SIMILARITY": "0.9", "SEMBLEND_MODE": "substitute"}
    s = settings_from_extra_config({"min_similarity": 0.65}, environ=env)
    assert s.config.min_similarity == 0.65 and s.mode == "discovery_only"
    s = settings_from_extra_config({}, environ=env)
    assert s.config.min_similarity == 0.9


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"mode": "exact_spans"}, "mode"),
        ({"mode": "exact_prefix", "discovery_only": True}, "discovery_only"),
        ({"donor_block_fraction": 0}, "donor_block_fraction"),
        ({"donor_block_fraction": True}, "donor_block_fraction"),
        ({"kv_cache_layout": "nhd"}, "kv_cache_layout"),
        ({"provider": "remote"}, "provider"),
        ({"min_similarity": "high"}, "min_similarity"),
        ({"min_prompt_tokens": -1}, "min_prompt_tokens"),
    ],
)
def test_bad_values_name_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings_from_extra_config(extra, environ={})
    assert err.value.key == key
    assert key in str(err.value)


def test_not_an_object_is_an_error() -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config"):
        settings_from_extra_config(["mode"], environ={})  # type: ignore[arg-type]


def test_modes_are_the_semblend_vllm_connector_packages() -> None:
    assert CONNECTOR_MODES == ("discovery_only", "exact_prefix", "request_only_experimental")
