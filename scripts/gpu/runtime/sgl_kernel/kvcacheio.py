"""``sgl_kernel.kvcacheio`` of the GPU stand-in: the host<->device KV transfer kernels sglang's
host memory pools (HiCache) import under ``is_cuda()``. Each raises when called: the kit runs
without HiCache, so none is reached; a run that enables it needs the real sgl_kernel."""

from __future__ import annotations

from . import make_raising_stub

NAMES = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)
"""Every name this submodule defines, each a raising stub."""

for _name in NAMES:
    globals()[_name] = make_raising_stub(f"kvcacheio.{_name}")
del _name
