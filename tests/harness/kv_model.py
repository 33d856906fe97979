"""The deterministic KV model every cache harness writes and every checker compares against.

K/V at position p is a function of (token, p, layer, namespace, h_p) where
h_p = H(h_{p-1}, token_p) chains through the KV the request attends to (h_{p-1} is read back from
the pool slot at p-1 of the request's own row). A prefix KV that came from other tokens therefore
propagates into everything computed after it, as it does in a real model, and a slot's KV is
"cold" exactly when it equals `cold_kv` of its own token path.

Pure torch: no sglang, no vLLM (tests/vllm/vllm_harness.py uses it too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NAMESPACE_NONE: tuple[str | None, str | None] = (None, None)
HASH_MODULUS = 8_388_593  # prime below 2**23: every value stays exact in float32
HASH_MULTIPLIER = 1_000_003
NAMESPACE_SEED_MULTIPLIER = 7_919
FIELD_TOKEN, FIELD_POS, FIELD_HASH, FIELD_NS, FIELD_LAYER = 0, 1, 2, 3, 4


def namespace_seed(ns_id: int) -> int:
    """Chain value before position 0 for namespace `ns_id` (the model's initial state)."""
    return (ns_id * NAMESPACE_SEED_MULTIPLIER + 1) % HASH_MODULUS


def chain_hash(prev: int, token: int) -> int:
    """h_p = H(h_{p-1}, token_p): the context summary the deterministic model carries."""
    return (prev * HASH_MULTIPLIER + token + 1) % HASH_MODULUS


def chain_hashes(prev: int, tokens: Sequence[int]) -> list[int]:
    """All h_p for `tokens`, starting after chain value `prev`."""
    out: list[int] = []
    h = prev
    for t in tokens:
        h = chain_hash(h, int(t))
        out.append(h)
    return out


def cold_kv(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    hashes: torch.Tensor,
    ns_ids: torch.Tensor,
    layer: int,
    head_num: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([n, head_num, head_dim], float32) a cold prefill writes for these tokens.

    Pure function of its arguments; every value is an integer below 2**23, so exact in float32.
    Fields 0-4 of K carry token, position, chain hash, namespace and layer for decoding.
    """
    n = tokens.numel()
    t = tokens.to(torch.int64)
    p = positions.to(torch.int64)
    h = hashes.to(torch.int64)
    s = ns_ids.to(torch.int64)
    base = torch.arange(head_num, dtype=torch.float32).view(head_num, 1) * 67.0 + torch.arange(
        head_dim, dtype=torch.float32
    ).view(1, head_dim)
    k_row = (t * 7 + p * 13 + (h % 1009) * 3 + s * 29 + layer * 17).to(torch.float32)
    v_row = (t * 5 + p * 11 + (h % 997) * 2 + s * 31 + layer * 3).to(torch.float32)
    k = k_row.view(n, 1, 1) + base
    v = v_row.view(n, 1, 1) - base
    fields = torch.stack([t, p, h, s, torch.full_like(t, layer)], dim=1).to(torch.float32)
    k[:, :, :5] = fields.view(n, 1, 5)
    v[:, :, 0] = h.to(torch.float32).view(n, 1)
    return k, v
