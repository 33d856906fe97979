"""Import-only stand-in for ``sgl_kernel`` under SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1).

With the CPU engine, a handful of sglang modules run ``from sgl_kernel import <name>_cpu`` at
import time (KV-cache move, req-to-token assignment, speculative-decoding helpers). The real
package ships only CUDA builds on PyPI. None of those functions is called when a dense model is
served on a CPU without AMX. This module lets the imports succeed and makes any call fail loudly:
it appends the name to the file named by ``SEMBLEND_SGL_KERNEL_STANDIN_LOG`` (when set) and
raises. Only names ending in ``_cpu`` resolve; anything else is an ImportError, as without the
package.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

IS_SEMBLEND_STANDIN = True
__version__ = "0.0.0+semblend.standin"
_LOG_ENV = "SEMBLEND_SGL_KERNEL_STANDIN_LOG"


def _record(event: str) -> None:
    path = os.environ.get(_LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {event}\n")


_record("import")


def _make_standin(qualname: str) -> Callable[..., NoReturn]:
    def standin(*_args: Any, **_kwargs: Any) -> NoReturn:
        _record(f"call {qualname}")
        raise RuntimeError(
            f"sgl_kernel.{qualname} was called, but sgl_kernel here is semblend-sglang's "
            "import-only CPU stand-in (see docs/cpu.md). This model or feature needs the real "
            "sgl_kernel CPU build."
        )

    standin.__name__ = qualname.rsplit(".", 1)[-1]
    standin.__qualname__ = qualname
    return standin


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.endswith("_cpu"):
        fn = _make_standin(name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"module 'sgl_kernel' (CPU stand-in) has no attribute {name!r}")
