"""semblend-sglang: semantic KV-cache reuse for SGLang (and vLLM).

Finds an earlier request (the donor) whose KV is still resident, aligns its tokens with a new
request's tokens, and lets the engine reuse the donor's KV for the aligned spans, RoPE-corrected,
while the engine's own exact prefix cache stays exact (docs/sglang.md).

``patch_radix_cache(config=None)`` / ``unpatch_radix_cache()`` install and remove the SGLang
hooks in this process (before an in-process ``sglang.Engine`` is created; servers get them
through the ``sglang.srt.plugins`` entry point). They are resolved lazily: importing this
package imports neither sglang nor torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "patch_radix_cache", "unpatch_radix_cache"]

_LAZY = {"patch_radix_cache", "unpatch_radix_cache"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from .patches import sglang as _sglang_patch

        return getattr(_sglang_patch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
