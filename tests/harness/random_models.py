"""Tiny random-weight HF model folders of the shapes the kernels' RopeSpec accepts, for serving
with the real SGLang 0.5.23 CPU server.

Each folder holds ``config.json``, ``model.safetensors`` (bf16, seeded normal draws) and the
prepared SmolLM2's tokenizer files, so the same text tokenizes to the same ids as with SmolLM2.
The shapes (:data:`SHAPES`):

* ``qwen2_theta1e6``: Qwen2ForCausalLM, ``rope_theta`` 1e6, q/k/v biases;
* ``llama3_scaling``: LlamaForCausalLM with ``rope_scaling`` llama3;
* ``qwen2_yarn``: Qwen2ForCausalLM with ``rope_scaling`` YaRN (its attention factor scales K);
* ``llama_partial_rotary``: LlamaForCausalLM with ``partial_rotary_factor`` 0.5 (SGLang's
  ``LlamaAttention`` reads that field and rotates the first half of each head);
* ``olmo2_unknown_class``: Olmo2ForCausalLM (q/k RMSNorm over whole projections), a class the
  recompute layer hook does not know; RopeSpec accepts its RoPE, so a decline comes from the
  hook, not from the RoPE check.

Folders are cached under :func:`semblend_sglang.model_prep.default_cache_dir` (the tests set it
to the clone's ``.cache/models``), named by a digest of everything that goes into them: a changed
spec, seed or tokenizer builds a new folder; an unchanged one is reused. Written into a temporary
sibling folder and renamed into place, like the prepared SmolLM2.

Weights: every matrix and bias a normal draw (``std``; q/k projections ``qk_std``, larger, so
attention is sharp and a passage's KV depends on what precedes it; the output projection
``lm_head_std``, larger, so the logits' top tokens are far apart and greedy decoding does not
hinge on float noise); norm weights as the model class initializes them. Each tensor is drawn
from a generator seeded by (seed, parameter name), so a draw does not depend on the order or
the number of the other parameters.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
"""Bumped whenever the way a folder is built changes (invalidates every cached folder)."""

MARKER = "semblend-random-model.json"
"""File in a finished folder recording what it was built from."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""Files copied from the tokenizer folder when present (``tokenizer.json`` must be)."""

_TOKEN_ID_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
"""Fields taken from the tokenizer folder's config.json, so ids mean the same tokens."""

_BASE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class RandomModelSpec:
    """One tiny random model: its HF architecture, model type and config fields over the base
    shape (hidden 128, 4 layers, 4 query heads of 32 over 2 KV heads, untied output layer)."""

    name: str
    architecture: str
    model_type: str
    config: Mapping[str, Any] = field(default_factory=dict)
    std: float = 0.05
    qk_std: float = 0.2
    lm_head_std: float = 0.5
    seed: int = 0

    def config_dict(self, token_fields: Mapping[str, Any]) -> dict[str, Any]:
        """The config.json contents: base shape, this spec's fields, the tokenizer's ids."""
        out: dict[str, Any] = dict(_BASE)
        out.update(self.config)
        out.update(token_fields)
        out["architectures"] = [self.architecture]
        out["model_type"] = self.model_type
        return out

    def digest(self, tokenizer_digest: str) -> str:
        """Hex digest of everything a folder is built from (spec, format, tokenizer files)."""
        payload = {
            "format": FORMAT_VERSION,
            "spec": {
                "name": self.name,
                "architecture": self.architecture,
                "model_type": self.model_type,
                "config": dict(self.config),
                "std": self.std,
                "qk_std": self.qk_std,
                "lm_head_std": self.lm_head_std,
                "seed": self.seed,
            },
            "tokenizer": tokenizer_digest,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


SHAPES: dict[str, RandomModelSpec] = {
    spec.name: spec
    for spec in (
        RandomModelSpec(
            name="qwen2_theta1e6",
            architecture="Qwen2ForCausalLM",
            model_type="qwen2",
            config={"rope_theta": 1_000_000.0, "use_sliding_window": False},
        ),
        RandomModelSpec(
            name="llama3_scaling",
            architecture="LlamaForCausalLM",
            model_type="llama",
            config={
                "rope_theta": 500_000.0,
                # original_max 512: at head dim 32 the frequencies fall in all three llama3
                # bands (kept, smoothed, divided by the factor), so the scaling is exercised.
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 512,
                },
            },
        ),
        RandomModelSpec(
            name="qwen2_yarn",
            architecture="Qwen2ForCausalLM",
            model_type="qwen2",
            config={
                "rope_theta": 10_000.0,
                "use_sliding_window": False,
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 1024,
                },
            },
        ),
        RandomModelSpec(
            name="llama_partial_rotary",
            architecture="LlamaForCausalLM",
            model_type="llama",
            config={"rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        ),
        RandomModelSpec(
            name="olmo2_unknown_class",
            architecture="Olmo2ForCausalLM",
            model_type="olmo2",
            config={"rope_theta": 10_000.0, "attention_bias": False},
        ),
    )
}
"""The shapes by name (see the module doc)."""


def _tokenizer_digest(tokenizer_dir: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = tokenizer_dir / name
        if path.is_file():
            h.update(name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _token_fields(tokenizer_dir: Path) -> dict[str, Any]:
    config = json.loads((tokenizer_dir / "config.json").read_text())
    return {k: config[k] for k in _TOKEN_ID_FIELDS if config.get(k) is not None}


def default_cache_dir() -> Path:
    """The folder random models are cached in: semblend's model cache (``$SEMBLEND_MODEL_CACHE``
    or ``~/.cache/semblend-sglang/models``), ``random/`` under it."""
    from semblend_sglang.model_prep import default_cache_dir as model_cache

    return model_cache() / "random"


def model_folder(spec: RandomModelSpec, tokenizer_dir: Path, cache_dir: Path | None = None) -> Path:
    """Where the folder of ``spec`` with the tokenizer of ``tokenizer_dir`` lives (built or not)."""
    digest = spec.digest(_tokenizer_digest(tokenizer_dir))[:12]
    return (cache_dir or default_cache_dir()) / f"{spec.name}-{digest}"


def is_built(folder: Path) -> bool:
    """True when ``folder`` is a finished build (its marker and weights exist)."""
    return (folder / MARKER).is_file() and (folder / "model.safetensors").is_file()


def build_random_model(
    spec: RandomModelSpec, tokenizer_dir: Path, cache_dir: Path | None = None
) -> Path:
    """Build the folder of ``spec`` (weights, config, tokenizer files from ``tokenizer_dir``,
    which must hold a ``config.json`` naming the vocabulary size and special ids) unless a
    finished one is cached; return its path."""
    target = model_folder(spec, tokenizer_dir, cache_dir)
    if is_built(target):
        return target
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        config = spec.config_dict(_token_fields(tokenizer_dir))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_weights(spec, tmp)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, tmp / name)
        marker = {"format": FORMAT_VERSION, "spec": spec.name, "digest": target.name}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _std_of(spec: RandomModelSpec, name: str) -> float:
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return spec.qk_std
    if name.startswith("lm_head."):
        return spec.lm_head_std
    return spec.std


def _is_norm(name: str) -> bool:
    return "norm" in name.rsplit(".", 2)[-2]


def _write_weights(spec: RandomModelSpec, folder: Path) -> None:
    """Instantiate the architecture with transformers (for parameter names, shapes and norm
    initialization) and save seeded draws as bf16 safetensors (tied weights saved once)."""
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        if _is_norm(name):
            value = tensor.detach().clone()
        else:
            gen = torch.Generator().manual_seed(_seed_of(spec.seed, name))
            value = torch.randn(tensor.shape, generator=gen) * _std_of(spec, name)
        state[name] = value.to(torch.bfloat16).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
