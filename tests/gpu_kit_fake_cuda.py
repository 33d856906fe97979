"""Imports sglang's server-path modules as a CUDA host would, on a CPU machine (helper of
tests/test_gpu_kit.py; run it in a subprocess, never imported by a test process).

    python tests/gpu_kit_fake_cuda.py OUT.json ALLOW.json MODULE [MODULE ...]

The GPU runtime folder (scripts/gpu/runtime) must be on ``PYTHONPATH``: its ``sitecustomize``
installs the fixes the kit ships, and its ``sgl_kernel`` / ``IPython`` stand-ins are found
first. Before anything imports sglang this script makes torch report one CUDA device of compute
capability 9.0 (an H100: ``torch.cuda.is_available``, ``torch.version.cuda``, the device
queries), so every ``if is_cuda():`` branch of sglang runs, and defines torchvision's operator
schemas (a CPU-only need: PyPI's torchvision is CUDA-linked). No kernel runs.

ALLOW.json (``{"distributions": [...], "modules": [...]}``) says what the GPU host would have:
an import of any other top-level module that is not in the standard library fails with
ModuleNotFoundError, as it would there, even though this machine's venv has it. The names so
refused are reported (sglang guards many optional imports with try/except).

Writes OUT.json: ``{"failed": {module: error}, "modules": {name: file}, "stand_in": ...}`` where
``modules`` is every module loaded at the end (with its file when it has one), ``stand_in`` the
names looked up on the ``sgl_kernel`` stand-in that it lacks, the calls it received, which runtime
fixes are active, what ``DualGemm._select_mode`` answered for a bf16 Llama MLP and what
``memory_pool.can_use_store_cache`` answers for 1,024-byte rows, and which path
(``BaseFusedOp`` backend) RMSNorm, SiluAndMul and RoPE took when run once on CPU tensors.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import re
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

H100 = SimpleNamespace(
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    total_memory=80 * 2**30,
    multi_processor_count=132,
    L2_cache_size=50 * 2**20,
    gcnArchName="",
    uuid="00000000-0000-0000-0000-000000000000",
)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def allowed_top_level(distributions: list[str], modules: list[str]) -> set[str]:
    """Top-level import names of the installed ``distributions`` (those not installed here give
    none), plus ``modules``, plus the standard library and the interpreter's own entries."""
    wanted = {_normalize(d) for d in distributions}
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | set(modules)
    names |= {"__main__", "__mp_main__", "sitecustomize", "usercustomize"}
    for top, dists in importlib.metadata.packages_distributions().items():
        if any(_normalize(d) in wanted for d in dists):
            names.add(top)
    return names


class HostOnly(importlib.abc.MetaPathFinder):
    """Stands in for the path finder: finds nothing for a top-level name outside ``allowed``
    (so ``import`` raises ModuleNotFoundError and ``importlib.util.find_spec`` answers None, as
    on a host without the package); records each name so refused."""

    def __init__(self, allowed: set[str], distributions: set[str]) -> None:
        self.allowed = allowed
        self.distributions = {_normalize(d) for d in distributions}
        self.refused: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        top = fullname.partition(".")[0]
        if top in self.allowed or top.startswith(("__editable__", "_sysconfigdata")):
            return importlib.machinery.PathFinder.find_spec(fullname, path, target)
        self.refused.add(top)
        return None

    def find_distributions(self, context: Any = None) -> Any:
        """The path finder's distributions, less those the host would not have."""
        found = importlib.machinery.PathFinder.find_distributions(
            context or importlib.metadata.DistributionFinder.Context()
        )
        return (d for d in found if _normalize(d.metadata["Name"] or "") in self.distributions)

    def invalidate_caches(self) -> None:
        importlib.machinery.PathFinder.invalidate_caches()

    def install(self) -> None:
        """Take the path finder's place in ``sys.meta_path``."""
        sys.meta_path[:] = [
            self if f is importlib.machinery.PathFinder else f for f in sys.meta_path
        ]


def fake_cuda() -> None:
    """Make torch report one H100 (capability 9.0) without touching a driver."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *_a, **_k: (9, 0)
    torch.cuda.get_device_name = lambda *_a, **_k: H100.name
    torch.cuda.get_device_properties = lambda *_a, **_k: H100


def select_mode_answer() -> Any:
    """What ``DualGemm._select_mode`` returns for a bf16 unquantized MLP of an 8B Llama shape."""
    import torch
    from sglang.srt.layers.dual_gemm import DualGemm
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    gate_up = SimpleNamespace(
        quant_method=UnquantizedLinearMethod(),
        params_dtype=torch.bfloat16,
        output_partition_sizes=[14336, 14336],
    )
    gemm = DualGemm.__new__(DualGemm)
    gemm.down_proj = SimpleNamespace()
    gemm.tp_size = 1
    gemm.max_tokens = 0
    mode = gemm._select_mode(gate_up, 4096)
    return None if mode is None else str(mode)


def fused_op_paths() -> dict[str, Any]:
    """Run RMSNorm (plain and with residual), SiluAndMul and a NeoX RotaryEmbedding once on CPU
    tensors through ``BaseFusedOp.forward`` with sglang's fused-op trace on; returns op name ->
    the backends the calls took (``torch`` is ``forward_native``), or the error."""
    import torch
    from sglang.kernels.fused_op import (
        clear_fused_op_trace,
        disable_fused_op_trace,
        enable_fused_op_trace,
        get_fused_op_trace,
    )
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope

    x = torch.randn(4, 64)
    rope = get_rope(32, 32, 128, 10000, is_neox_style=True, dtype=torch.float32)
    clear_fused_op_trace()
    enable_fused_op_trace()
    try:
        norm = RMSNorm(64)
        norm(x)
        norm(x.clone(), x.clone())
        SiluAndMul()(torch.randn(4, 128))
        rope(torch.arange(4), torch.randn(4, 64), torch.randn(4, 64))
    finally:
        disable_fused_op_trace()
    paths: dict[str, Any] = {}
    for record in get_fused_op_trace():
        paths.setdefault(record.op, set()).add(record.backend)
    return {op: sorted(backends) for op, backends in paths.items()}


def main(out: Path, allow: Path, modules: list[str]) -> None:
    """Import ``modules`` with CUDA faked and only what ``allow`` lists importable; write the
    report described above to ``out``."""
    spec = json.loads(allow.read_text())
    host_only = HostOnly(
        allowed_top_level(spec["distributions"], spec["modules"]), set(spec["distributions"])
    )
    host_only.install()
    fake_cuda()
    from semblend_sglang.cpu_runtime.torchvision_shim import define_torchvision_schemas

    define_torchvision_schemas()
    failed: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:
            failed[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}"
    try:
        select_mode: Any = select_mode_answer()
    except BaseException as exc:
        select_mode = f"raised {type(exc).__name__}: {exc}"
    try:
        paths: Any = fused_op_paths()
    except BaseException as exc:
        paths = f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}"
    try:
        from sglang.srt.mem_cache import memory_pool

        store_cache: Any = memory_pool.can_use_store_cache(1024, 1024)
    except BaseException as exc:
        store_cache = f"raised {type(exc).__name__}: {exc}"
    sgl_kernel = sys.modules.get("sgl_kernel")
    runtime = sys.modules.get("semblend_gpu_runtime")
    report = {
        "failed": failed,
        "refused": sorted(host_only.refused),
        "modules": {
            name: getattr(module, "__file__", None)
            for name, module in sorted(sys.modules.items())
            if module is not None
        },
        "stand_in": {
            "sgl_kernel_file": getattr(sgl_kernel, "__file__", None),
            "missing": sorted(getattr(sgl_kernel, "MISSING", ())),
            "calls": dict(getattr(sgl_kernel, "CALLS", {})),
            "active": dict(getattr(runtime, "ACTIVE", {})),
            "select_mode": select_mode,
            "can_use_store_cache": store_cache,
            "fused_op_paths": paths,
        },
    }
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
