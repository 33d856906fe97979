"""KV-transfer kernels, installed as ``semblend_sglang.kernels``.

``RopeSpec.from_hf_config`` reads a model's RoPE from its config; ``rotate_k`` re-rotates keys
by a position delta; ``transfer_kv_sglang`` / ``transfer_kv_paged`` gather donor slots, rotate
K and scatter K and V into recipient slots for all layers in one launch. Each Triton kernel
(``*_triton``) sits beside the torch reference (``*_ref``) it is tested against; CPU tensors use
the reference for rotate_k and ``transfer_cpu`` (bit-identical to the reference) for the
transfer. See docs/kernels.md.
"""

from semblend_sglang.kernels.dispatch import (
    Backend,
    rotate_k,
    transfer_kv_paged,
    transfer_kv_sglang,
)
from semblend_sglang.kernels.kv_layouts import SlotOverlapError
from semblend_sglang.kernels.rope_spec import RopeConfigError, RopeSpec

__all__ = [
    "Backend",
    "RopeConfigError",
    "RopeSpec",
    "SlotOverlapError",
    "rotate_k",
    "transfer_kv_paged",
    "transfer_kv_sglang",
]
