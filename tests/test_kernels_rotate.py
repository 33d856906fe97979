"""rotate_k against transformers' own rotary embeddings, on real SmolLM2 keys of a real essay.

The property that matters: a key cached at position p, rotated by d, equals the key the model
computes at position p + d (within a per-dtype tolerance derived from rounding, below).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kernels_real_keys import real_keys
from transformers import GPTJConfig, GPTNeoXConfig, LlamaConfig, Qwen2Config
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import (
    apply_rotary_pos_emb as neox_apply_rotary,
)
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply_rotary
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from semblend_sglang.kernels import RopeSpec, rotate_k

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (first position p0, delta d): forward, backward, far forward.
SHIFTS = ((0, 1000), (3000, -2500), (100, 20000))
N_TOKENS = 192


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the Triton path on CPU: the kernel is compiled lazily under TRITON_INTERPRET=1."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def keys(smollm2_model_dir: Path, smollm2_tokenizer: Any, essay_texts: list[str]) -> torch.Tensor:
    """Real pre-RoPE layer-0 keys [192, 3, 64] of the first essay's first tokens."""
    ids = smollm2_tokenizer(essay_texts[0])["input_ids"][:N_TOKENS]
    assert len(ids) == N_TOKENS
    return real_keys(smollm2_model_dir, ids)


def _smollm2(model_dir: Path) -> LlamaConfig:
    return LlamaConfig.from_pretrained(model_dir)


def _qwen2() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=1e6,
        max_position_embeddings=32768,
    )


def _llama3_scaled() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def _yarn_scaled() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )


def _tolerance(k: torch.Tensor, dtype: torch.dtype, positions: list[torch.Tensor]) -> float:
    """Max abs error allowed: about eight half-ulps of the key's magnitude in ``dtype``
    (transformers rounds cos/sin and each product to dtype on both sides, rotate_k rounds once)
    plus fp32 angle rounding, |angle error| <= |position| * 2**-24 per angle formed."""
    span = sum(int(p.abs().max()) for p in positions)
    scale = float(k.abs().max())
    return scale * (4 * torch.finfo(dtype).eps + 2 * span * 2.0**-24)


def _hf_llama_style(rope: torch.nn.Module, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """K [tokens, heads, dim] embedded at ``pos`` by transformers' rotary class and apply fn."""
    x = k.transpose(0, 1)[None]
    cos, sin = rope(x, pos[None])
    _, k_embed = apply_rotary_pos_emb(x, x, cos, sin)
    return k_embed[0].transpose(0, 1)


CONFIGS = {
    "smollm2": (_smollm2, LlamaRotaryEmbedding),
    "qwen2_theta_1e6": (lambda _d: _qwen2(), Qwen2RotaryEmbedding),
    "llama3_scaled": (lambda _d: _llama3_scaled(), LlamaRotaryEmbedding),
    "yarn_scaled": (lambda _d: _yarn_scaled(), Qwen2RotaryEmbedding),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rotated_key_equals_key_at_shifted_position(
    name: str, keys: torch.Tensor, smollm2_model_dir: Path
) -> None:
    make_config, rope_cls = CONFIGS[name]
    config = make_config(smollm2_model_dir)
    spec = RopeSpec.from_hf_config(config)
    rope = rope_cls(config)
    n = keys.shape[0]
    for p0, d0 in SHIFTS:
        pos = torch.arange(n) + p0
        deltas = d0 + torch.arange(n) % 7 - 3  # several deltas per span, as per-token allows
        for dtype in DTYPES:
            k_in = keys.to(dtype)
            at_p = _hf_llama_style(rope, k_in, pos)
            at_pd = _hf_llama_style(rope, k_in, pos + deltas)
            moved = rotate_k(at_p, deltas, spec)
            assert moved.dtype == dtype
            err = (moved.float() - at_pd.float()).abs().max().item()
            tol = _tolerance(keys, dtype, [pos, deltas, pos + deltas])
            assert err <= tol, f"{name} p0={p0} d={d0} {dtype}: err {err:.3e} > {tol:.3e}"
            # The check can fail: one position off is far outside the tolerance.
            off_by_one = rotate_k(at_p, deltas + 1, spec)
            assert (off_by_one.float() - at_pd.float()).abs().max().item() > 10 * tol


@pytest.mark.parametrize("name", ["smollm2", "llama3_scaled"])
@pytest.mark.usefixtures("triton_interpreter")
def test_triton_path_matches_transformers(
    name: str, keys: torch.Tensor, smollm2_model_dir: Path
) -> None:
    make_config, rope_cls = CONFIGS[name]
    config = make_config(smollm2_model_dir)
    spec = RopeSpec.from_hf_config(config)
    rope = rope_cls(config)
    pos = torch.arange(keys.shape[0]) + 3000
    deltas = torch.full((keys.shape[0],), -2500)
    for dtype in DTYPES:
        at_p = _hf_llama_style(rope, keys.to(dtype), pos)
        at_pd = _hf_llama_style(rope, keys.to(dtype), pos + deltas)
        moved = rotate_k(at_p, deltas, spec, backend="triton")
        err = (moved.float() - at_pd.float()).abs().max().item()
        assert err <= _tolerance(keys, dtype, [pos, deltas, pos + deltas])


def test_partial_rotary_neox_against_gpt_neox(keys: torch.Tensor) -> None:
    config = GPTNeoXConfig(hidden_size=576, num_attention_heads=9, rotary_pct=0.25)
    spec = RopeSpec.from_hf_config(config)
    assert (spec.rotary_dim, spec.is_neox_style) == (16, True)
    rope = GPTNeoXRotaryEmbedding(config)

    def at(pos: torch.Tensor) -> torch.Tensor:
        x = keys.transpose(0, 1)[None]
        cos, sin = rope(x, pos[None])
        _, k_embed = neox_apply_rotary(x, x, cos, sin)
        return k_embed[0].transpose(0, 1)

    pos = torch.arange(keys.shape[0]) + 50
    deltas = torch.arange(keys.shape[0]) * 37 - 40
    moved = rotate_k(at(pos), deltas, spec)
    assert torch.equal(moved[..., 16:], keys[..., 16:])  # unrotated dims untouched
    err = (moved - at(pos + deltas)).abs().max().item()
    assert err <= _tolerance(keys, torch.float32, [pos, deltas, pos + deltas])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gptj_interleaved_partial_against_gptj(
    backend: str, keys: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = GPTJConfig(n_embd=576, n_head=9, rotary_dim=32)
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_dim, spec.is_neox_style) == (64, 32, False)
    table = create_sinusoidal_positions(8192, 32)

    def at(pos: torch.Tensor) -> torch.Tensor:
        sin, cos = torch.split(table[pos][None], 16, dim=-1)
        x = keys[None]  # [1, tokens, heads, dim], as GPT-J applies it
        rot = gptj_apply_rotary(x[..., :32], sin, cos)
        return torch.cat([rot, x[..., 32:]], dim=-1)[0]

    pos = torch.arange(keys.shape[0]) * 3
    deltas = 4000 - torch.arange(keys.shape[0]) * 5
    moved = rotate_k(at(pos), deltas, spec, backend=backend)  # type: ignore[arg-type]
    err = (moved - at(pos + deltas)).abs().max().item()
    assert err <= _tolerance(keys, torch.float32, [pos, deltas, pos + deltas])


def test_interleaved_against_complex_formula(keys: torch.Tensor) -> None:
    """Independent fp64 reference: interleaved pairs as complex numbers times e^{i d w}."""
    spec = RopeSpec(head_dim=64, rotary_dim=48, rope_theta=1e4, is_neox_style=False)
    deltas = torch.arange(keys.shape[0], dtype=torch.int64) * 11 - 900
    moved = rotate_k(keys, deltas, spec)
    w = spec.inv_freq().double()
    z = torch.view_as_complex(keys[..., :48].double().reshape(*keys.shape[:2], 24, 2).contiguous())
    z = z * torch.polar(torch.ones_like(w), deltas.double()[:, None] * w)[:, None, :]
    expected = torch.cat([torch.view_as_real(z).flatten(-2), keys[..., 48:].double()], dim=-1)
    tol = float(keys.abs().max()) * 2 * 2000 * 2.0**-24
    assert (moved.double() - expected).abs().max().item() <= tol


def test_zero_delta_is_bit_exact_and_rotations_compose(keys: torch.Tensor) -> None:
    spec = RopeSpec(head_dim=64, rotary_dim=64, rope_theta=1e5)
    zero = torch.zeros(keys.shape[0], dtype=torch.int64)
    for dtype in DTYPES:
        assert torch.equal(rotate_k(keys.to(dtype), zero, spec), keys.to(dtype))
    d1 = torch.arange(keys.shape[0]) * 13
    d2 = -torch.arange(keys.shape[0]) * 5
    twice = rotate_k(rotate_k(keys, d1, spec), d2, spec)
    once = rotate_k(keys, d1 + d2, spec)
    assert (twice - once).abs().max().item() <= float(keys.abs().max()) * 6 * 2500 * 2.0**-24
