"""Attention-backend hooks for a sparse extend, at start-up: the registry of the backends they
serve (one ``attention_<name>`` module each, exporting its :class:`.hook_kit.HookedBackend`),
their install and removal, and the refusals common to every backend (:func:`common_refusal`),
which depend only on how a backend instance was configured.

Every backend but torch_native is given a batch holding a sparse request as its split view
(:mod:`.split_view`, which defines both) through its own ``init_forward_metadata`` and
``forward_extend`` (:func:`.hook_kit.split_view_wrappers`); each backend's module says what it
does differently. Batches without a sparse request are untouched, and a batch holding one never
replays the prefill CUDA graph (:func:`.unified.prefill_graph_wrappers`).

SGLang's own path is kept for what this cannot match (cross or encoder-only attention, sliding
window, encoder lens, no 1-D ``positions``, speculative modes); a sparse batch that reaches such a
path raises :class:`.hook_kit.SparseExtendUnsupported` instead of computing wrong attention.
Callers decide beforehand with :func:`sparse_extend_supported`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from semblend_sglang.config_fields import parse_flag
from semblend_sglang.plan import Reason

from ..wrapping import Originals, install_wrappers, restore
from . import (
    fa3_backend,
    flashinfer_backend,
    torch_native_backend,
    triton_backend,
    trtllm_mha_backend,
)
from .hook_kit import HookedBackend
from .torch_native_backend import set_query_only_every_extend
from .triton_backend import set_sparse_path

logger = logging.getLogger(__name__)

CPU_QUERY_ONLY_ENV = "SEMBLEND_CPU_QUERY_ONLY_EXTEND"
"""Set to 0 to keep SGLang's torch_native extend on a CPU runtime (default on)."""

HOOKED_BACKENDS: dict[str, HookedBackend] = {
    entry.name: entry
    for entry in (
        torch_native_backend.HOOKED,
        triton_backend.HOOKED,
        fa3_backend.HOOKED,
        flashinfer_backend.HOOKED,
        trtllm_mha_backend.HOOKED,
    )
}
"""The registry: every backend the hooks serve, by ``--attention-backend`` name."""

GPU_BACKENDS = tuple(name for name in HOOKED_BACKENDS if name != "torch_native")
"""Hooked backends besides torch_native (installed by :func:`install_attention_hooks`)."""

UNSERVED_BACKENDS: dict[str, str] = {
    "aiter": "ROCm; its extend picks among several paths per batch (flash_attn_varlen_func over "
    "this pass's fresh K/V, mha_batch_prefill over the paged pool, fp8 prefill), and the "
    "fresh-K/V ones would miss earlier runs' KV as flashinfer's ragged path does; the aiter "
    "kernels do not import without ROCm, so no path is tested with the split view",
    "fa4": "a different kernel (CuTe DSL, FA4) behind the same FlashAttentionBackend class; "
    "not tested with the split view (fa3 is)",
    "flashmla": "MLA: its compressed KV cache is not copied",
    "cutlass_mla": "MLA: its compressed KV cache is not copied",
    "trtllm_mla": "MLA: its compressed KV cache is not copied",
    "flashinfer_mla": "MLA: its compressed KV cache is not copied",
    "intel_amx": "a CPU kernel without a position-masked or split-view extend",
}
"""Why each backend SGLang can resolve to declines, by name (docs/sglang.md's table)."""


def backend_reuse_reason(backend: str) -> str | None:
    """Why a sparse extend cannot run on prefill backend ``backend``, or None when it can (every
    hooked backend serves every page size SGLang allows it). Read by the doctor and by
    :func:`attention_supported`; per instance, :func:`sparse_extend_supported` decides."""
    if backend in HOOKED_BACKENDS:
        return None
    why = UNSERVED_BACKENDS.get(backend, "not a backend the split view is tested on")
    return f"attention backend {backend}: {why}"


def _dcp_size() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), "attn_dcp_size", 1) or 1)
    except Exception:
        return 1


def common_refusal(backend: Any) -> bool:
    """True when ``backend`` (an attention backend instance) has what no hooked backend serves: a
    sliding-window KV pool, MLA, a translating (unified) pool, whose page tables are read through
    a plan built for the real batch's rows, or decode context parallelism. Read by
    :func:`backend_serves`."""
    translator = getattr(backend, "kv_index_translator", None)
    return (
        bool(getattr(backend, "use_sliding_window_kv_pool", False))
        or bool(getattr(backend, "use_mla", False))
        or bool(getattr(translator, "is_translating", False))
        or bool(getattr(translator, "reads_are_translated", False))
        or getattr(backend, "dcp_size", 1) != 1
        or _dcp_size() != 1
    )


def backend_serves(entry: HookedBackend, backend: Any) -> bool:
    """True iff ``backend`` (an instance of ``entry``'s class) has no :func:`common_refusal` and
    none of ``entry.supported``'s; its hooks refuse a sparse batch otherwise. Never raises."""
    try:
        return not common_refusal(backend) and bool(entry.supported(backend))
    except Exception:
        return False


_lock = threading.Lock()
_originals: dict[str, Originals] = {}


def _install(name: str) -> bool:
    """Install backend ``name``'s hooks; False when its SGLang module does not import here (then
    no instance of it can exist in this process either)."""
    if name in _originals:
        return True
    entry = HOOKED_BACKENDS[name]
    try:
        module = importlib.import_module(entry.module)
    except ImportError as exc:
        logger.debug("semblend: %s hooks not installed (%s)", name, exc)
        return False
    serves = functools.partial(backend_serves, entry)
    _originals[name] = install_wrappers(entry.wrappers(getattr(module, entry.cls), serves))
    return True


def install_attention_hooks(triton: bool = True, gpu_backends: Iterable[str] | None = None) -> None:
    """Install the torch_native hooks, the triton ones when ``triton``, and those of each name in
    ``gpu_backends`` (default: every one in :data:`GPU_BACKENDS` when CUDA is available, none
    otherwise; a backend whose module does not import is skipped); idempotent.

    Batches without a sparse request keep SGLang's path unless
    :func:`install_cpu_query_only_extend` turned on the query-only extend for every batch.
    """
    if gpu_backends is None:
        gpu_backends = GPU_BACKENDS if torch.cuda.is_available() else ()
    names = {"torch_native", *gpu_backends} | ({"triton"} if triton else set())
    with _lock:
        for name in HOOKED_BACKENDS:
            if name in names:
                _install(name)


def remove_attention_hooks() -> None:
    """Restore every method this module replaced, turn ``every_extend`` off and the sparse path
    back to ``auto``; idempotent."""
    with _lock:
        for name in list(_originals):
            restore(_originals.pop(name))
        set_query_only_every_extend(False)
    set_sparse_path("auto")


def hooks_installed(name: str) -> bool:
    """True while the hooks of backend ``name`` (a key of :data:`HOOKED_BACKENDS`) are installed."""
    return name in _originals


def sparse_extend_supported(backend: Any) -> bool:
    """True iff ``backend`` (an attention backend instance) runs a sparse extend correctly: its
    class is one of the hooked backends, its hooks are installed, and :func:`backend_serves`
    accepts it. Any other backend (hybrid ones included) is False: callers decline such requests
    as ``unsupported_cache``. Never raises.
    """
    for name, entry in HOOKED_BACKENDS.items():
        if type(backend).__name__ == entry.cls and hooks_installed(name):
            return backend_serves(entry, backend)
    return False


def runner_supported(model_runner: Any) -> bool:
    """:func:`sparse_extend_supported` for ``model_runner``'s attention backend (True without
    one), logged when it cannot run a sparse extend: the request flow declines every plan from
    then on. Called once, at the first forward."""
    backend = getattr(model_runner, "attn_backend", None)
    if backend is None or sparse_extend_supported(backend):
        return True
    logger.warning(
        "semblend: attention backend %s cannot run a sparse extend; every plan is declined as %s",
        type(backend).__name__,
        Reason.UNSUPPORTED_CACHE,
    )
    return False


def _flag(value: str | None, default: bool) -> bool:
    flag = parse_flag(value)
    return default if flag is None else flag


def install_cpu_query_only_extend(environ: Mapping[str, str] | None = None) -> bool:
    """Plugin hook: on a CPU runtime, make torch_native's extend query-only for every batch.

    Applies when ``SGLANG_USE_CPU_ENGINE`` is 1/true/yes/on and ``SEMBLEND_CPU_QUERY_ONLY_EXTEND``
    is not 0/false/no/off (default on), whether or not ``SEMBLEND_ENABLED`` is set. It only changes
    ``TorchNativeAttnBackend``, so other backends are unaffected. Returns True when applied;
    never raises (a failure is logged and leaves SGLang unchanged).
    """
    env = os.environ if environ is None else environ
    if not _flag(env.get("SGLANG_USE_CPU_ENGINE"), False) or not _flag(
        env.get(CPU_QUERY_ONLY_ENV), True
    ):
        return False
    try:
        with _lock:
            _install("torch_native")
        set_query_only_every_extend(True)
        return True
    except Exception as exc:
        logger.error(
            "semblend: CPU query-only extend not installed (%s: %s)", type(exc).__name__, exc
        )
        return False


def attention_supported() -> bool:
    """False (logged once) when the server's prefill attention backend cannot run a sparse
    extend; True when it can or when no server context exists (the cache alone, as in an
    in-process cache harness)."""
    return served_attention_refusal() is None


def served_attention_refusal() -> str | None:
    """Why the server's prefill attention backend cannot run a sparse extend (logged once per
    process), or None when it can or when no server context exists. The scheduler's start-up
    hook calls it so the reason is known before the first request."""
    global _unsupported_logged
    try:
        from sglang.srt.runtime_context import attention_backends

        prefill, _ = attention_backends()
    except Exception:
        return None
    reason = None if prefill is None else backend_reuse_reason(str(prefill))
    if reason is None:
        return None
    if not _unsupported_logged:
        _unsupported_logged = True
        logger.warning(
            "semblend: %s (served: %s); every plan is declined as %s",
            reason,
            ", ".join(sorted(HOOKED_BACKENDS)),
            Reason.UNSUPPORTED_CACHE,
        )
    return reason


_unsupported_logged = False
