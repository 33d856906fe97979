"""A float32 torch forward of a Llama or Qwen2 checkpoint whose every layer's K/V can be
replaced: the model of ``bench blend-sim`` (:mod:`.blend_sim`). Measurement only: nothing in
serving imports it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from semblend_sglang.kernels.rope_spec import RopeSpec
from semblend_sglang.kernels.rotate_ref import rotate_fp32


@dataclass
class AttentionWatch:
    """Attention paid by some computed rows, added up across layers: ``rows`` index the rows
    given to :meth:`LlamaReference.layer`; ``total`` [all rows] gains, per layer, their softmax
    attention to each row averaged over those rows and the query heads."""

    rows: torch.Tensor
    total: torch.Tensor


@dataclass
class Prefill:
    """Per layer K (RoPE applied) and V [tokens, kv_heads, head_dim], the hidden states entering
    each layer (``hidden[l]``, and ``hidden[-1]`` after the last) of the computed rows."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: list[torch.Tensor]


ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""What :class:`LlamaReference` models: the same decoder, Qwen2 with q/k/v biases."""


class LlamaReference:
    """A float32 forward of a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` checkpoint
    (``config.json`` and ``model.safetensors`` in one folder) whose every layer's K/V can be
    replaced. Attention projections use their biases where the checkpoint has them. Attention is
    causal by position over all rows given, so rows may be a subset (a sparse extend). Not fast,
    not batched; raises ValueError on another architecture, MLP biases or a sliding window."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors.torch import load_file

        config = json.loads((model_dir / "config.json").read_text())
        architectures = config.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
            raise ValueError(f"{model_dir}: not one of {ARCHITECTURES} ({architectures})")
        if config.get("mlp_bias"):
            raise ValueError(f"{model_dir}: MLP biases are not modelled")
        if config.get("use_sliding_window"):
            raise ValueError(f"{model_dir}: a sliding window is not modelled")
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config["num_key_value_heads"])
        self.eps = float(config["rms_norm_eps"])
        self.rope = RopeSpec.from_hf_config(config)
        self.head_dim = self.rope.head_dim
        self.w = {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return out if bias is None else out + bias

    def layer(
        self,
        index: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        watch: AttentionWatch | None = None,
    ) -> torch.Tensor:
        """Layer ``index`` for ``hidden`` (the rows ``rows`` at ``positions``): writes their K/V
        into ``keys``/``values`` (all rows, row i at position i), attends over all of them; adds
        the attention of ``watch.rows`` into ``watch.total``."""
        p = f"model.layers.{index}."
        x = self._norm(hidden, p + "input_layernorm.weight")
        n, d = x.shape[0], self.head_dim
        q = self._proj(x, p + "self_attn.q_proj").view(n, self.heads, d)
        k = self._proj(x, p + "self_attn.k_proj").view(n, self.kv_heads, d)
        keys[rows] = rotate_fp32(k, positions, self.rope)
        values[rows] = self._proj(x, p + "self_attn.v_proj").view(n, self.kv_heads, d)
        q = rotate_fp32(q, positions, self.rope)
        group = self.heads // self.kv_heads
        kk, vv = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
        later = torch.arange(keys.shape[0])[None, None, :] > positions[None, :, None]
        attn = scores.masked_fill(later, float("-inf")).softmax(-1)
        if watch is not None:
            watch.total += attn[:, watch.rows].mean(dim=(0, 1))
        out = torch.einsum("hqk,khd->qhd", attn, vv).reshape(n, -1)
        hidden = hidden + self._proj(out, p + "self_attn.o_proj")
        x = self._norm(hidden, p + "post_attention_layernorm.weight")
        gate = torch.nn.functional.silu(x @ self.w[p + "mlp.gate_proj.weight"].T)
        up = x @ self.w[p + "mlp.up_proj.weight"].T
        return hidden + (gate * up) @ self.w[p + "mlp.down_proj.weight"].T

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits of hidden states after the last layer."""
        return self._norm(hidden, "model.norm.weight") @ self.lm_head.T

    @torch.no_grad()
    def prefill(self, ids: Sequence[int]) -> Prefill:
        """Every position of ``ids`` computed in every layer (a cold prefill)."""
        n = len(ids)
        rows = torch.arange(n)
        hidden = self.w["model.embed_tokens.weight"][torch.tensor(list(ids))]
        out = Prefill([], [], [hidden])
        for index in range(self.layers):
            keys = torch.zeros(n, self.kv_heads, self.head_dim)
            values = torch.zeros_like(keys)
            hidden = self.layer(index, hidden, rows, rows, keys, values)
            out.keys.append(keys)
            out.values.append(values)
            out.hidden.append(hidden)
        return out

    @torch.no_grad()
    def greedy(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], last: torch.Tensor, steps: int
    ) -> tuple[list[int], list[float]]:
        """``steps`` greedy tokens after a prefill whose per-layer K/V are ``keys``/``values`` and
        whose last position's final hidden state is ``last``; with each token's top-1 / top-2
        logit margin (a logprob margin: the normalizer cancels)."""
        keys, values = list(keys), list(values)
        tokens: list[int] = []
        margins: list[float] = []
        logits = self.logits(last)
        for step in range(steps):
            top = logits.topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            if step == steps - 1:
                break
            at = torch.tensor([keys[0].shape[0]])
            hidden = self.w["model.embed_tokens.weight"][torch.tensor(tokens[-1:])]
            for index in range(self.layers):
                pad = torch.zeros(1, self.kv_heads, self.head_dim)
                keys[index] = torch.cat([keys[index], pad])
                values[index] = torch.cat([values[index], pad])
                hidden = self.layer(index, hidden, at, at, keys[index], values[index])
            logits = self.logits(hidden[-1])
        return tokens, margins
