"""Defines the ``torchvision::nms`` / ``torchvision::qnms`` operator schemas on CPU-only torch.

PyPI's torchvision wheels are built against CUDA torch; with the CPU build of torch their C
extension fails to load, and ``torchvision._meta_registrations`` then dies registering fake
kernels for operators that were never defined. sglang imports torchvision through its multimodal
configs, so the whole server would fail to import. Defining the two schemas first is enough for
that import to succeed; calling either operator still fails (no kernel is registered), which no
text-only model does.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Any

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_lock = threading.Lock()
_library: Any = None  # torch.library.Library; kept alive so the schemas stay registered


def define_torchvision_schemas() -> bool:
    """Define the missing schemas once per process; returns True if this call defined them.

    Safe to call repeatedly and from any thread. Imports torch. Does nothing when the operators
    already exist (a working torchvision extension, or an earlier call).
    """
    global _library
    with _lock:
        if _library is not None:
            return False
        import torch

        if _op_exists("nms"):
            return False
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _SCHEMAS:
            lib.define(schema)
        _library = lib
        return True


def _op_exists(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class _TorchvisionImportHook(importlib.abc.MetaPathFinder):
    """Meta-path finder that defines the schemas just before ``torchvision`` is first imported.

    It never finds a module itself: it returns None so the normal finders import torchvision.
    Keeps processes that never import torchvision from paying for a torch import.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            define_torchvision_schemas()
        return None


def install_torchvision_hook() -> None:
    """Arrange for the schemas to exist before torchvision's first import in this process.

    Called by the CPU runtime's ``sitecustomize`` (spawned sglang processes) and by
    :func:`semblend_sglang.cpu_runtime.activate_in_process`. Idempotent.
    """
    if "torchvision" in sys.modules:
        define_torchvision_schemas()
        return
    if not any(isinstance(f, _TorchvisionImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionImportHook())
