"""Real pre-RoPE keys for the kernel tests: SmolLM2 layer-0 K projections of real essay tokens.

A helper module (not a test): the tests import it, so keys come from the real model and text.
"""

from __future__ import annotations

from pathlib import Path

import torch


def real_keys(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """fp32 keys [tokens, kv_heads, head_dim] before RoPE: k_proj(rmsnorm(embed(tokens)))."""
    import json

    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    names = (
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.k_proj.weight",
    )
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        embed, norm, k_proj = (f.get_tensor(n).to(torch.float32) for n in names)
    h = embed[torch.tensor(token_ids, dtype=torch.int64)]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * norm
    k = h @ k_proj.T
    return k.view(len(token_ids), config["num_key_value_heads"], config["head_dim"])
