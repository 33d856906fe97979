"""RopeSpec.from_hf_config: fields read from real and representative configs, refusals named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPTJConfig, GPTNeoXConfig, LlamaConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from semblend_sglang.kernels import RopeConfigError, RopeSpec


def test_smollm2_config_json_and_object_agree(smollm2_model_dir: Path) -> None:
    raw = json.loads((smollm2_model_dir / "config.json").read_text())
    from_dict = RopeSpec.from_hf_config(raw)
    from_obj = RopeSpec.from_hf_config(LlamaConfig.from_pretrained(smollm2_model_dir))
    assert from_dict == from_obj
    assert (from_dict.head_dim, from_dict.rotary_dim) == (64, 64)
    assert from_dict.rope_theta == 100000.0
    assert from_dict.is_neox_style and from_dict.scaling == "default"


def test_legacy_rope_theta_and_rope_scaling_dict() -> None:
    raw = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    spec = RopeSpec.from_hf_config(raw)
    assert (spec.head_dim, spec.rope_theta, spec.scaling, spec.factor) == (128, 5e5, "linear", 2.0)


def test_qwen2_theta() -> None:
    spec = RopeSpec.from_hf_config(Qwen2Config(rope_theta=1e6))
    assert spec.rope_theta == 1e6 and spec.is_neox_style


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "original_max_position_embeddings": 4096,
        },
    ],
    ids=["linear", "llama3", "yarn", "yarn_betas"],
)
def test_scaled_inv_freq_equals_transformers(params: dict[str, Any]) -> None:
    config = LlamaConfig(
        hidden_size=2048,
        num_attention_heads=16,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **params},
    )
    spec = RopeSpec.from_hf_config(config)
    expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    assert spec.scaling == params["rope_type"]
    assert torch.equal(spec.inv_freq(), expected)


def test_partial_rotary_fields() -> None:
    assert (
        RopeSpec.from_hf_config(GPTNeoXConfig(hidden_size=512, num_attention_heads=8)).rotary_dim
        == 16
    )
    raw = {"hidden_size": 2560, "num_attention_heads": 32, "partial_rotary_factor": 0.5}
    assert RopeSpec.from_hf_config(raw).rotary_dim == 40


def test_layout_from_fields() -> None:
    gptj = RopeSpec.from_hf_config(GPTJConfig(n_embd=4096, n_head=16, rotary_dim=64))
    assert (gptj.is_neox_style, gptj.rotary_dim, gptj.rope_theta) == (False, 64, 10000.0)
    base = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8}
    assert RopeSpec.from_hf_config(base).is_neox_style
    assert not RopeSpec.from_hf_config({**base, "rope_is_neox_style": False}).is_neox_style
    assert not RopeSpec.from_hf_config({**base, "rotary_interleaved": True}).is_neox_style
    assert not RopeSpec.from_hf_config(base, is_neox_style=False).is_neox_style


BASE = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "rope_theta": 1e4}


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type='dynamic'",
        ),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "'longrope'"),
        (
            {"rope_scaling": {"rope_type": "default", "mrope_section": [16, 24, 24]}},
            "mrope_section",
        ),
        ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [16, 24, 24]}}, "mrope_section"),
        ({"rope_scaling": {"rope_type": "made_up"}}, "rope_type='made_up' is unknown"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor is missing"),
        ({"kv_lora_rank": 512}, "kv_lora_rank=512"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}}, "nested per layer type"),
        ({"alibi": True}, "alibi"),
        ({"position_embedding_type": "absolute"}, "position_embedding_type='absolute'"),
        ({"rope_local_base_freq": 1e4}, "rope_local_base_freq=10000.0"),
        ({"no_rope_layers": [1, 1, 0, 1]}, "no_rope_layers"),
        ({"no_rope_layer_interval": 4}, "no_rope_layer_interval=4"),
        ({"nope_layer_interval": 4}, "nope_layer_interval=4"),
        ({"sliding_window_pattern": 4}, "sliding_window_pattern=4"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types mixes"),
        ({"partial_rotary_factor": 0.3}, "must be even"),
        ({"rotary_dim": 16, "partial_rotary_factor": 0.5}, "disagrees"),
    ],
)
def test_refused_configs_name_the_field(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(RopeConfigError) as info:
        RopeSpec.from_hf_config({**BASE, **extra})
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("config_class", "needle"),
    [
        ("Gemma3TextConfig", "layer_types mixes"),
        ("Cohere2Config", "layer_types mixes"),
        ("SmolLM3Config", "no_rope_layers"),
        ("Llama4TextConfig", "no_rope_layers"),
    ],
)
def test_models_whose_layers_differ_in_rope_are_refused(config_class: str, needle: str) -> None:
    """transformers' own configs of models with per-layer RoPE or NoPE layers: one spec for
    every layer would rotate some layers' keys wrongly."""
    import transformers

    with pytest.raises(RopeConfigError) as info:
        RopeSpec.from_hf_config(getattr(transformers, config_class)())
    assert needle in str(info.value)


@pytest.mark.parametrize("config_class", ["LlamaConfig", "Qwen2Config", "MistralConfig"])
def test_models_with_one_rope_for_every_layer_are_accepted(config_class: str) -> None:
    import transformers

    spec = RopeSpec.from_hf_config(getattr(transformers, config_class)())
    assert spec.rotary_dim > 0
