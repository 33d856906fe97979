"""CPU runtime that lets the real SGLang 0.5.23 serve a model on a machine without CUDA.

Two pieces, both in ``site/`` (see docs/cpu.md): an import-only ``sgl_kernel`` stand-in and a
``sitecustomize`` that defines the torchvision operator schemas before torchvision is imported
and gives SGLang's KV canary its CPU stand-ins (:mod:`.canary_shim`).
The launcher calls :func:`runtime_environ` for the server's environment, so spawned scheduler and
detokenizer processes load them too; in-process users call :func:`activate_in_process`. Nothing
here edits site-packages, and nothing is applied where CUDA is available.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "site"
"""Folder put on PYTHONPATH: holds ``sitecustomize.py`` and the ``sgl_kernel`` stand-in."""


def cuda_available() -> bool:
    """True when torch sees a CUDA device; the CPU runtime is then never applied."""
    import torch

    return bool(torch.cuda.is_available())


def runtime_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return a copy of ``base`` (default ``os.environ``) set up for SGLang's CPU engine.

    On a machine without CUDA: ``SITE_DIR`` first on PYTHONPATH and ``SGLANG_USE_CPU_ENGINE=1``.
    With CUDA: an unchanged copy. Does not modify ``base``.
    """
    env = dict(os.environ if base is None else base)
    if cuda_available():
        return env
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *parts])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


def activate_in_process() -> bool:
    """Apply the CPU runtime to this process and to the processes it will spawn.

    For in-process engines (``sglang.Engine``) and tests: updates ``os.environ`` as
    :func:`runtime_environ` does, puts ``SITE_DIR`` on ``sys.path`` and installs the torchvision
    and KV canary hooks. Call it before sglang is imported. Returns False (and changes nothing)
    when CUDA is available. Idempotent.
    """
    if cuda_available():
        return False
    os.environ.update(runtime_environ())
    if str(SITE_DIR) not in sys.path:
        sys.path.insert(0, str(SITE_DIR))
    from .canary_shim import install_canary_cpu_hook
    from .torchvision_shim import install_torchvision_hook

    install_torchvision_hook()
    install_canary_cpu_hook()
    return True


def ensure_torchvision_importable() -> None:
    """On a machine without CUDA, make a later ``import torchvision`` succeed in this process.

    transformers and sglang import torchvision when it is installed; PyPI's CUDA-linked wheel
    fails under CPU torch (docs/cpu.md). Callers: model preparation, the benchmarks, the tests.
    Changes nothing with CUDA. Idempotent.
    """
    if cuda_available():
        return
    from .torchvision_shim import install_torchvision_hook

    install_torchvision_hook()
