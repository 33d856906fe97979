"""``sgl_kernel.quantization`` of the GPU stand-in: the GGUF (ggml) quantized GEMM kernels
sglang's gguf quantization module imports under ``is_cuda()``. Each raises when called: the kit
serves unquantized (dummy or bf16) weights only."""

from __future__ import annotations

from .. import make_raising_stub

NAMES = ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8")
"""Every name this submodule defines, each a raising stub."""

for _name in NAMES:
    globals()[_name] = make_raising_stub(f"quantization.{_name}")
del _name
