"""RopeSpec: the rotary-embedding parameters a key rotation needs, read from a model config.

Only what a model's config states is used; nothing is inferred from a model's name. Static
scalings (linear, llama3, YaRN) change the inverse frequencies and are supported; anything
whose rotation is not a fixed function of the position delta (dynamic NTK, multimodal RoPE,
LongRoPE, per-layer RoPE or NoPE layers, ...) is refused with :class:`RopeConfigError` naming
the config field.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_SCALINGS = ("default", "linear", "llama3", "yarn")
"""``rope_type`` values whose rotation depends only on the position delta."""

DEFAULT_ROPE_THETA = 10000.0
"""Base used when a config names none (transformers' and SGLang's default)."""

INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "cohere", "cohere2", "glm", "glm4"})
"""``model_type`` values whose configs carry no layout field but whose SGLang and transformers
implementations rotate interleaved pairs (GPT-J style). The only place ``model_type`` is read."""

_REFUSED_SCALINGS = {
    "dynamic": "dynamic NTK rescales frequencies with the sequence length",
    "longrope": "LongRoPE switches frequency tables with the sequence length",
    "su": "LongRoPE (su) switches frequency tables with the sequence length",
    "mrope": "multimodal RoPE rotates sections by separate position ids",
    "deepseek_yarn": "DeepSeek YaRN belongs to MLA's latent cache layout",
    "proportional": "proportional RoPE is not supported",
}

_REFUSED_FIELDS = {
    "kv_lora_rank": "MLA (latent KV) caches are not an MHA K/V layout",
    "dual_chunk_attention_config": "dual-chunk attention re-maps positions per chunk",
    "rope_ratio": "ChatGLM-style rope_ratio layouts are not supported",
}


class RopeConfigError(ValueError):
    """A model config whose RoPE cannot be corrected by a delta rotation; names the field."""


def _field(config: Any, name: str) -> Any:
    """``config[name]`` for a mapping, ``getattr(config, name)`` otherwise; None when absent."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates keys: layout, rotary dims, base and static scaling.

    ``is_neox_style`` True means NeoX half-split pairs (i, i + rotary_dim/2); False means
    GPT-J interleaved pairs (2i, 2i + 1). Dims from ``rotary_dim`` to ``head_dim`` are not
    rotated. YaRN's attention factor is not part of the spec: it is already inside cached K,
    and a rotation keeps it.
    """

    head_dim: int
    rotary_dim: int
    rope_theta: float
    is_neox_style: bool = True
    scaling: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    extrapolation_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.scaling not in SUPPORTED_SCALINGS:
            raise RopeConfigError(f"rope_type={self.scaling!r} is not supported")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise RopeConfigError(
                f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
            )
        if self.rope_theta <= 0:
            raise RopeConfigError(f"rope_theta={self.rope_theta} must be positive")

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The fp32 inverse frequencies [rotary_dim // 2] the model uses (scaling applied).

        Cached per (spec, device); callers must not modify the returned tensor.
        """
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return _inv_freq_cached(self, str(dev))

    @classmethod
    def from_hf_config(cls, config: Any, *, is_neox_style: bool | None = None) -> RopeSpec:
        """Read the spec from a transformers config object or a config.json dict.

        Accepts transformers 5 ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``.
        ``is_neox_style`` overrides the layout when the engine knows it (e.g. SGLang's rotary
        module for GGUF-loaded Llama weights uses GPT-J style). Raises RopeConfigError, naming
        the field and value, for anything a delta rotation cannot correct.
        """
        for name, why in _REFUSED_FIELDS.items():
            if _field(config, name) is not None:
                raise RopeConfigError(f"{name}={_field(config, name)!r}: {why}")
        _refuse_per_layer_rope(config)
        if _field(config, "alibi"):
            raise RopeConfigError("alibi=True: the model uses ALiBi, not RoPE")
        pos_type = _field(config, "position_embedding_type")
        if pos_type is not None and pos_type not in ("rope", "rotary"):
            raise RopeConfigError(f"position_embedding_type={pos_type!r}: the model has no RoPE")

        params, params_field = _rope_params(config)
        rope_type = str(params.get("rope_type") or params.get("type") or "default")
        if "mrope_section" in params:
            raise RopeConfigError(
                f"{params_field}.mrope_section={params['mrope_section']!r}: "
                "multimodal RoPE rotates sections by separate position ids"
            )
        for flag in ("use_fope", "video_rope"):
            if params.get(flag):
                raise RopeConfigError(f"{params_field}.{flag}={params[flag]!r} is not supported")
        if rope_type in _REFUSED_SCALINGS:
            raise RopeConfigError(
                f"{params_field}.rope_type={rope_type!r}: {_REFUSED_SCALINGS[rope_type]}"
            )
        if rope_type not in SUPPORTED_SCALINGS:
            raise RopeConfigError(f"{params_field}.rope_type={rope_type!r} is unknown")

        head_dim = _head_dim(config)
        rotary_dim = _rotary_dim(config, params, head_dim)
        theta = _first(
            params.get("rope_theta"),
            _field(config, "rope_theta"),
            _field(config, "rotary_emb_base"),
            DEFAULT_ROPE_THETA,
        )
        max_pos = _field(config, "max_position_embeddings")
        orig_max = _first(
            params.get("original_max_position_embeddings"),
            _field(config, "original_max_position_embeddings"),
            max_pos,
            0,
        )
        factor = params.get("factor")
        if rope_type == "yarn" and factor is None and max_pos and orig_max:
            factor = max_pos / orig_max
        if rope_type in ("linear", "llama3", "yarn"):
            if factor is None:
                raise RopeConfigError(f"{params_field}.factor is missing for {rope_type!r}")
            if float(factor) <= 0:
                raise RopeConfigError(f"{params_field}.factor={factor!r} must be positive")
        if rope_type in ("llama3", "yarn") and not orig_max:
            raise RopeConfigError(
                f"{params_field}.original_max_position_embeddings is missing for {rope_type!r}"
            )
        return cls(
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=float(theta),
            is_neox_style=_layout(config) if is_neox_style is None else bool(is_neox_style),
            scaling=rope_type,
            factor=float(factor) if factor is not None else 1.0,
            low_freq_factor=float(_first(params.get("low_freq_factor"), 1.0)),
            high_freq_factor=float(_first(params.get("high_freq_factor"), 4.0)),
            original_max_position_embeddings=int(orig_max),
            beta_fast=float(_first(params.get("beta_fast"), 32.0)),
            beta_slow=float(_first(params.get("beta_slow"), 1.0)),
            extrapolation_factor=float(_first(params.get("extrapolation_factor"), 1.0)),
            truncate=bool(_first(params.get("truncate"), True)),
        )


def _refuse_per_layer_rope(config: Any) -> None:
    """Raise RopeConfigError when the config states layers whose RoPE differs from the others
    (one spec is applied to every layer): Gemma-3's local base, NoPE layers (SmolLM3, Llama 4),
    interleaved layer types (Cohere2, Gemma-3)."""
    local = _field(config, "rope_local_base_freq")
    if local is not None:
        raise RopeConfigError(f"rope_local_base_freq={local!r}: local layers use another RoPE base")
    no_rope = _field(config, "no_rope_layers")
    if no_rope is not None and not all(bool(x) for x in no_rope):
        raise RopeConfigError("no_rope_layers has 0 entries: some layers have no RoPE (NoPE)")
    for name in ("no_rope_layer_interval", "nope_layer_interval"):
        interval = _field(config, name)
        if interval:
            raise RopeConfigError(f"{name}={interval!r}: every n-th layer has no RoPE (NoPE)")
    pattern = _field(config, "sliding_window_pattern")
    if pattern is not None and int(pattern) > 1:
        raise RopeConfigError(
            f"sliding_window_pattern={pattern!r}: local and global layers differ in RoPE"
        )
    layer_types = _field(config, "layer_types")
    if layer_types is not None and len(set(layer_types)) > 1:
        raise RopeConfigError(
            f"layer_types mixes {', '.join(sorted(set(map(str, layer_types))))}: "
            "layers of different types differ in RoPE"
        )


def _first(*values: Any) -> Any:
    """The first value that is not None."""
    for value in values:
        if value is not None:
            return value
    return None


def _rope_params(config: Any) -> tuple[dict[str, Any], str]:
    """The flat RoPE parameter dict and the field it came from."""
    for name in ("rope_parameters", "rope_scaling"):
        raw = _field(config, name)
        if raw is None:
            continue
        if not isinstance(raw, Mapping):
            raise RopeConfigError(f"{name}={raw!r} is not a mapping")
        nested = [k for k, v in raw.items() if isinstance(v, Mapping)]
        if nested:
            raise RopeConfigError(
                f"{name} is nested per layer type ({', '.join(sorted(nested))}): "
                "layers use different RoPE"
            )
        return dict(raw), name
    return {}, "rope_parameters"


def _head_dim(config: Any) -> int:
    head_dim = _field(config, "head_dim")
    if head_dim:
        return int(head_dim)
    hidden, heads = _field(config, "hidden_size"), _field(config, "num_attention_heads")
    if not hidden or not heads:
        raise RopeConfigError("head_dim is missing and hidden_size/num_attention_heads are too")
    return int(hidden) // int(heads)


def _rotary_dim(config: Any, params: Mapping[str, Any], head_dim: int) -> int:
    explicit = _field(config, "rotary_dim")
    fraction = _first(
        params.get("partial_rotary_factor"),
        _field(config, "partial_rotary_factor"),
        _field(config, "rotary_pct"),
    )
    from_fraction = int(head_dim * float(fraction)) if fraction is not None else None
    if explicit is not None and from_fraction is not None and int(explicit) != from_fraction:
        raise RopeConfigError(
            f"rotary_dim={explicit!r} disagrees with partial_rotary_factor={fraction!r} "
            f"(head_dim={head_dim})"
        )
    rotary_dim = int(_first(explicit, from_fraction, head_dim))
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise RopeConfigError(
            f"rotary_dim={rotary_dim} (from rotary_dim/partial_rotary_factor) must be even "
            f"and in (0, head_dim={head_dim}]"
        )
    return rotary_dim


def _layout(config: Any) -> bool:
    """True for NeoX half-split, False for GPT-J interleaved, from config fields."""
    neox = _field(config, "rope_is_neox_style")
    if neox is not None:
        return bool(neox)
    for name in ("rotary_interleaved", "rope_interleaved", "rope_interleave"):
        value = _field(config, name)
        if value is not None:
            return not bool(value)
    return _field(config, "model_type") not in INTERLEAVED_MODEL_TYPES


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(spec: RopeSpec, device: str) -> torch.Tensor:
    return compute_inv_freq(spec).to(device)


def compute_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """fp32 inverse frequencies on CPU, with the formulas transformers and SGLang use."""
    dim = spec.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    pos_freqs = spec.rope_theta**exponents
    inv_freq = 1.0 / pos_freqs
    if spec.scaling == "linear":
        return inv_freq / spec.factor
    if spec.scaling == "llama3":
        return _llama3(inv_freq, spec)
    if spec.scaling == "yarn":
        return _yarn(pos_freqs, spec)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    old_len = spec.original_max_position_embeddings
    low_wavelen = old_len / spec.low_freq_factor
    high_wavelen = old_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    if spec.high_freq_factor == spec.low_freq_factor:
        return scaled
    smooth = (old_len / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(pos_freqs: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    dim, base = spec.rotary_dim, spec.rope_theta
    orig = spec.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp) * spec.extrapolation_factor
    interpolation = 1.0 / (spec.factor * pos_freqs)
    return interpolation * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
