"""The random-weight model folders of tests/harness/random_models.py: what RopeSpec reads from
each shape, that a build is deterministic and cached, and that the models are not degenerate
(greedy decoding with transformers gives varied tokens that depend on the prompt)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.kernels import RopeSpec
from tests.harness.random_models import (
    MARKER,
    SHAPES,
    TOKENIZER_FILES,
    build_random_model,
    model_folder,
)

EXPECTED_ROPE = {
    "qwen2_theta1e6": {"rope_theta": 1e6, "scaling": "default", "rotary_dim": 32},
    "llama3_scaling": {"rope_theta": 5e5, "scaling": "llama3", "factor": 8.0, "rotary_dim": 32},
    "qwen2_yarn": {"rope_theta": 1e4, "scaling": "yarn", "factor": 4.0, "rotary_dim": 32},
    "llama_partial_rotary": {"rope_theta": 1e4, "scaling": "default", "rotary_dim": 16},
    "olmo2_unknown_class": {"rope_theta": 1e4, "scaling": "default", "rotary_dim": 32},
}


@pytest.fixture(scope="module")
def built(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every shape built once into a fresh cache folder."""
    root = tmp_path_factory.mktemp("random-models")
    return {
        name: build_random_model(spec, smollm2_model_dir, root) for name, spec in SHAPES.items()
    }


def test_every_shape_is_listed_with_its_expected_rope() -> None:
    """The table below covers exactly the shapes the builder offers."""
    assert set(EXPECTED_ROPE) == set(SHAPES)


@pytest.mark.parametrize("name", sorted(EXPECTED_ROPE))
def test_rope_spec_reads_the_shapes_rope_from_the_file_and_from_transformers(
    name: str, built: dict[str, Path]
) -> None:
    """RopeSpec accepts each shape and reads the same RoPE from config.json and from the
    config object transformers resolves (which SGLang's model classes read)."""
    from transformers import AutoConfig

    folder = built[name]
    raw = json.loads((folder / "config.json").read_text())
    resolved = AutoConfig.from_pretrained(folder)
    spec = RopeSpec.from_hf_config(raw)
    assert RopeSpec.from_hf_config(resolved) == spec
    assert spec.is_neox_style and spec.head_dim == 32
    for field, value in EXPECTED_ROPE[name].items():
        assert getattr(spec, field) == value, (field, spec)


def test_partial_rotary_factor_is_a_top_level_field_sglangs_llama_reads(
    built: dict[str, Path],
) -> None:
    """SGLang 0.5.23's LlamaAttention rotates ``int(config.partial_rotary_factor * head_dim)``
    dims (a top-level attribute); transformers keeps the field there when it resolves the
    config."""
    from transformers import AutoConfig

    resolved: Any = AutoConfig.from_pretrained(built["llama_partial_rotary"])
    assert resolved.partial_rotary_factor == 0.5
    assert type(resolved).__name__ == "LlamaConfig"


def test_qwen2_shapes_carry_qkv_biases(built: dict[str, Path]) -> None:
    """Qwen2 folders hold q/k/v biases for every layer (K's bias is added before RoPE)."""
    from safetensors import safe_open

    for name in ("qwen2_theta1e6", "qwen2_yarn"):
        with safe_open(str(built[name] / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert f"model.layers.3.self_attn.{proj}.bias" in keys, (name, proj)


def test_folder_holds_the_tokenizer_and_its_ids(
    built: dict[str, Path], smollm2_model_dir: Path
) -> None:
    """Tokenizer files are copies of the prepared SmolLM2's; vocabulary size and special ids
    are SmolLM2's, so the same text gives the same ids with either model."""
    smol = json.loads((smollm2_model_dir / "config.json").read_text())
    for folder in built.values():
        config = json.loads((folder / "config.json").read_text())
        for key in ("vocab_size", "bos_token_id", "eos_token_id"):
            assert config[key] == smol[key], (folder.name, key)
        for name in TOKENIZER_FILES:
            src = smollm2_model_dir / name
            if src.is_file():
                assert (folder / name).read_bytes() == src.read_bytes(), (folder.name, name)


def test_build_is_deterministic_cached_and_keyed_by_the_spec(
    smollm2_model_dir: Path, tmp_path: Path
) -> None:
    """Two builds of one spec in two caches are byte-identical; a second build in the same cache
    reuses the folder; another seed gets another folder with other weights."""
    spec = SHAPES["llama_partial_rotary"]
    a = build_random_model(spec, smollm2_model_dir, tmp_path / "a")
    b = build_random_model(spec, smollm2_model_dir, tmp_path / "b")
    assert a.name == b.name and (a / MARKER).is_file()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert build_random_model(spec, smollm2_model_dir, tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    other = replace(spec, seed=spec.seed + 1)
    c = build_random_model(other, smollm2_model_dir, tmp_path / "a")
    assert c != a and c == model_folder(other, smollm2_model_dir, tmp_path / "a")
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_greedy_decoding_is_varied_and_depends_on_the_instruction(
    name: str, built: dict[str, Path], smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    """With transformers, 8 greedy tokens after instruction + passage are not one repeated
    token, and another instruction before the same passage changes them: the models are not
    degenerate, so the server tests' comparisons can fail."""
    import torch
    from transformers import AutoModelForCausalLM

    def enc(text: str) -> list[int]:
        ids: list[int] = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return ids

    passage = enc(essay_texts[0])[:300]
    model = AutoModelForCausalLM.from_pretrained(built[name], dtype=torch.float32).eval()
    outs = []
    for head in ("Summarize the following essay.\n\n", "Write a title for this essay.\n\n"):
        ids = torch.tensor([enc(head) + passage])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
            )
        outs.append(out[0, ids.shape[1] :].tolist())
    assert all(len(set(o)) >= 3 for o in outs), outs
    assert outs[0] != outs[1], outs
