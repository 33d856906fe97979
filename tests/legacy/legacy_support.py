"""Shared by the tests in tests/legacy: whether the installed sglang is a legacy version.

These tests run only in the second environment `make test-legacy` builds (.venv-legacy, sglang
0.5.15); in the main .venv (sglang 0.5.23) every module skips at collection with the reason
below, so `make test` is unaffected. Importing this module imports no sglang module.
"""

from __future__ import annotations

import os
import random
import socket

from semblend_sglang.patches.sglang.adapter import installed_sglang_version
from semblend_sglang.patches.sglang.legacy import (
    END_VERSION,
    FIRST_VERSION,
    LegacyRadixCacheAdapter,
)


def legacy_skip_reason() -> str | None:
    """None when the installed sglang is served by the legacy adapter, else why the tests skip."""
    version = installed_sglang_version()
    if version is None:
        return "sglang is not installed"
    if not LegacyRadixCacheAdapter.supports(version):
        return (
            f"installed sglang {version} is not a legacy version "
            f"({FIRST_VERSION} <= v < {END_VERSION}); run `make test-legacy`"
        )
    return None


def use_triton_interpreter() -> None:
    """Make sglang's own Triton kernels run on CPU (Triton's interpreter), for this process.

    0.5.15's `PagedTokenToKVPoolAllocator.alloc_extend` / `alloc_decode` always launch Triton
    kernels (mem_cache/allocator/paged.py), and `triton.jit` picks the interpreter when the
    function is defined, i.e. when sglang's module is imported: so this must run before any test
    imports sglang (module level, at collection). semblend's own kernels stay on their torch
    reference for CPU tensors (kernels/dispatch.py "auto"). The page-size-1 path is unaffected.
    """
    os.environ.setdefault("TRITON_INTERPRET", "1")


def legacy_port() -> int:
    """A free port below 55000: 0.5.15 refuses to start when port + 10000 (its gRPC port,
    server_args.py:2997-3004) exceeds 65535, which an OS-assigned port often does."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 55000")
