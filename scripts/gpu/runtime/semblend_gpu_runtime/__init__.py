"""Import-time fixes that let sglang 0.5.23 run on a CUDA host without its compiled extras.

Put the runtime folder (the parent of this package) on ``PYTHONPATH``: its ``sitecustomize``
calls :func:`activate` in every Python process, so sglang's spawned scheduler and detokenizer
get the same fixes as the launching process. In-process users may call :func:`activate`
directly before importing sglang. Two fixes, each a no-op where it is not needed:

- **DualGemm without the CuTe DSL.** Every Llama/Qwen2 MLP builds a ``DualGemm`` whose
  ``_select_mode`` imports ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` on CUDA; that module
  imports ``cutlass`` (nvidia-cutlass-dsl, ~91 MiB, not carried) at its top, so model
  construction fails without it. When ``cutlass`` cannot be imported, that one module is served
  by :mod:`semblend_gpu_runtime.dual_gemm_unavailable`, which answers "unavailable" (the kernel
  is SM100-only and cannot run without the DSL anyway). Where ``cutlass`` exists nothing changes.
- **store_cache.** ``memory_pool`` writes K/V with a JIT-compiled ``store_cache`` kernel when
  ``can_use_store_cache`` says it can be built. With ``SEMBLEND_GPU_STORE_CACHE=torch`` (the
  default) ``can_use_store_cache`` answers False, so K/V are written by sglang's own torch
  indexing path and no JIT build is attempted; ``=jit`` leaves sglang's choice alone.

Nothing here imports torch or sglang; the fixes are meta-path hooks that act when sglang's
modules load.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

DUAL_GEMM_MODULE = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"
KVCACHE_MODULE = "sglang.kernels.ops.kvcache.kvcache"
STORE_CACHE_ENV = "SEMBLEND_GPU_STORE_CACHE"
STORE_CACHE_MODES = ("torch", "jit")

ACTIVE: dict[str, bool] = {"dual_gemm_standin": False, "store_cache_torch": False}
"""Which fixes :func:`activate` installed in this process."""


def store_cache_mode() -> str:
    """The ``SEMBLEND_GPU_STORE_CACHE`` mode: ``torch`` (default) or ``jit``; ValueError else."""
    mode = os.environ.get(STORE_CACHE_ENV, "torch").strip().lower() or "torch"
    if mode not in STORE_CACHE_MODES:
        raise ValueError(f"{STORE_CACHE_ENV}={mode!r}: expected one of {STORE_CACHE_MODES}")
    return mode


def cutlass_importable() -> bool:
    """Whether a real ``cutlass`` (the CuTe DSL) is installed in this interpreter."""
    try:
        return importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False


def store_cache_unavailable(k_row_bytes: int, v_row_bytes: int = 0, num_threads: int = 0) -> bool:
    """Replacement for sglang's ``can_use_store_cache``: always False (use the torch path)."""
    return False


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Serves ``DUAL_GEMM_MODULE`` from the stand-in module instead of sglang's file."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != DUAL_GEMM_MODULE:
            return None
        origin = os.path.join(os.path.dirname(__file__), "dual_gemm_unavailable.py")
        return importlib.util.spec_from_file_location(fullname, origin)


class _PostImportPatch(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after the module named ``name`` finishes executing."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.patch = patch
        self._busy = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        patch = self.patch

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


def _patch_kvcache(module: Any) -> None:
    module.can_use_store_cache = store_cache_unavailable
    ACTIVE["store_cache_torch"] = True


def activate() -> dict[str, bool]:
    """Install the fixes this process needs (idempotent); returns :data:`ACTIVE`.

    Must run before sglang's model modules are imported to take effect for them. Raises
    ValueError on a bad ``SEMBLEND_GPU_STORE_CACHE``.
    """
    hooks = {type(f) for f in sys.meta_path}
    if not cutlass_importable() and _StandInFinder not in hooks:
        if DUAL_GEMM_MODULE not in sys.modules:
            sys.meta_path.insert(0, _StandInFinder())
            ACTIVE["dual_gemm_standin"] = True
    if store_cache_mode() == "torch" and not ACTIVE["store_cache_torch"]:
        loaded = sys.modules.get(KVCACHE_MODULE)
        if loaded is not None:
            _patch_kvcache(loaded)
            pool = sys.modules.get("sglang.srt.mem_cache.memory_pool")
            if pool is not None:
                pool.can_use_store_cache = store_cache_unavailable  # type: ignore[attr-defined]
        elif _PostImportPatch not in hooks:
            sys.meta_path.insert(0, _PostImportPatch(KVCACHE_MODULE, _patch_kvcache))
    return ACTIVE
