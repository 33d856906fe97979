"""``sgl_kernel.mamba`` part of the import-only CPU stand-in: ``*_cpu`` names resolve to functions
that record the call and raise (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from . import _make_standin


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.endswith("_cpu"):
        fn = _make_standin(f"mamba.{name}")
        globals()[name] = fn
        return fn
    raise AttributeError(f"module 'sgl_kernel.mamba' (CPU stand-in) has no attribute {name!r}")
