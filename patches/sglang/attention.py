"""Attention-backend hooks for a sparse extend, the registry of the backends they serve
(sglang 0.5.23's torch_native, triton, fa3, flashinfer, trtllm_mha), and the CPU runtime's
query-only extend.

A *sparse* request in an EXTEND batch is one with ``extend_prefix_len + extend_seq_len !=
seq_len``: its row ``req_to_token[row, 0:n]`` holds every position in order, its computed
tokens sit at ``forward_batch.positions`` (ascending), and a query at position ``p`` must see
every key at position ``<= p`` (contract: :mod:`semblend_sglang.kernels.sparse_extend`).

One mechanism serves every backend: the backend's own ``init_forward_metadata`` and
``forward_extend`` are given the batch's split view (:mod:`.split_view`: each computed run of a
sparse request as its own extend sequence). Batches without a sparse request are untouched.

- torch_native: a batch holding a sparse request runs :func:`extend_attention_query_only` on
  the real batch (SGLang's ``forward_extend`` with its SDPA call replaced), which masks by
  position itself. SGLang's own SDPA extend would carry the split view correctly (it writes the
  pass's KV first), but it loops over sequences, one per run, which is slower (docs/perf.md,
  "Split view on the CPU server: torch_native"). With the CPU runtime's query-only extend on
  (:func:`install_cpu_query_only_extend`), every extend batch runs the query-only extend.
- triton: ``init_forward_metadata`` and ``forward_extend`` get the split view (the kernel saves
  the pass's KV before it reads the prefix) when it costs no more tile work than one
  position-masked pass per request (:func:`.split_view.split_is_cheaper`); otherwise SGLang's
  metadata for the real batch is replaced by :func:`build_sparse_extend_metadata`'s and the
  kernel runs with ``skip_prefix_custom_mask=False``. Many short runs make the split view slow
  (each run reads its whole prefix again; docs/perf.md, "Split view on a GPU").
- fa3 (:mod:`.attention_fa3`), flashinfer and trtllm_mha (:mod:`.attention_flashinfer`; a
  flashinfer batch holding a sparse request is planned on its paged path, never the ragged one):
  the split view through their own metadata and kernel call, at every page size.

A batch holding a sparse request never replays the prefill CUDA graph (:mod:`.prefill_graph`).

SGLang's own path is kept for what this cannot match (cross or encoder-only attention, sliding
window, encoder lens, no 1-D ``positions``, speculative modes); a sparse batch that reaches such a
path raises :class:`SparseExtendUnsupported` instead of computing wrong attention. Callers decide
beforehand with :func:`sparse_extend_supported`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from semblend_sglang.config import SPARSE_PATHS
from semblend_sglang.config_fields import parse_flag
from semblend_sglang.kernels.sparse_extend import extend_attention_query_only
from semblend_sglang.kernels.sparse_extend_triton import (
    SKIP_PREFIX_CUSTOM_MASK,
    build_sparse_extend_metadata,
)
from semblend_sglang.plan import Reason

from .split_hooks import (
    BUILT_ATTR,
    SparseExtendUnsupported,
    SparsePath,
    SplitDifference,
    count_sparse_batch,
    is_plain_extend,
    scratch_room,
    split_view_wrappers,
)
from .split_view import batch_lens, is_sparse_batch, split_is_cheaper, split_view_of
from .wrapping import Originals, Wrappers, install_wrappers, restore

logger = logging.getLogger(__name__)

CPU_QUERY_ONLY_ENV = "SEMBLEND_CPU_QUERY_ONLY_EXTEND"
"""Set to 0 to keep SGLang's torch_native extend on a CPU runtime (default on)."""

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
    hooked backend serves every page size SGLang allows it). Read by the
    doctor and by :func:`attention_supported`; the per-instance conditions are
    :func:`sparse_extend_supported`'s."""
    entry = _hooked_backends().get(backend)
    if entry is None:
        why = UNSERVED_BACKENDS.get(backend, "not a backend the split view is tested on")
        return f"attention backend {backend}: {why}"
    return None


_lock = threading.Lock()
_originals: dict[str, Originals] = {}
_every_extend = False
_sparse_path = "auto"
"""The ``sparse_path`` setting (:func:`set_sparse_path`)."""


# ------------------------------------------------------------------------------------ batches
def query_positions(forward_batch: Any) -> tuple[torch.Tensor, bool] | None:
    """(position of every computed token, batch is sparse), or None when they cannot be known.

    Ordinary requests get ``arange(m, n)`` (SGLang's own query placement); sparse requests get
    their segment of ``forward_batch.positions``, which must then be 1-D with one entry per
    computed token. None for a batch that is not EXTEND/MIXED, has encoder lens, lacks the length
    fields, or has a sparse request without usable positions.
    """
    if not is_plain_extend(forward_batch) or forward_batch.encoder_lens is not None:
        return None
    lens = batch_lens(forward_batch)
    if lens is None:
        return None
    prefix, extend, seq = lens
    sparse = [m + c != n for m, c, n in zip(prefix, extend, seq, strict=True)]
    positions = forward_batch.positions
    if any(sparse) and (
        positions is None or positions.dim() != 1 or positions.shape[0] != sum(extend)
    ):
        return None
    device = forward_batch.seq_lens.device
    parts, start = [], 0
    for m, c, is_sparse in zip(prefix, extend, sparse, strict=True):
        if is_sparse:
            parts.append(positions[start : start + c].to(device=device, dtype=torch.int64))
        else:
            parts.append(torch.arange(m, m + c, device=device, dtype=torch.int64))
        start += c
    qpos = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
    return qpos, any(sparse)


# ------------------------------------------------------------------------------ torch_native
def _cached_positions(backend: Any, forward_batch: Any) -> tuple[torch.Tensor, bool] | None:
    """query_positions, computed once per forward batch (forward_extend runs once per layer):
    reused while the batch object, its ``positions`` tensor and its lengths are the same."""
    key = (id(forward_batch.positions), batch_lens(forward_batch))
    cached = getattr(backend, "_semblend_qpos", None)
    if cached is not None and cached[0]() is forward_batch and cached[1] == key:
        return cached[2]
    value = query_positions(forward_batch)
    try:
        backend._semblend_qpos = (weakref.ref(forward_batch), key, value)
    except TypeError:  # an object without weak references: no cache
        backend._semblend_qpos = None
    return value


def _torch_native_wrappers(native: type) -> dict[tuple[type, str], Any]:
    forward_extend = native.forward_extend
    run_sdpa = native._run_sdpa_forward_extend

    def query_only(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        """SGLang's forward_extend on the real batch with its SDPA call replaced by the
        position-masked query-only extend (:func:`extend_attention_query_only`)."""
        info = _cached_positions(self, forward_batch)
        if info is None and is_sparse_batch(forward_batch):
            raise SparseExtendUnsupported("torch_native: sparse extend without positions")
        if info is not None and info[1]:
            count_sparse_batch(SparsePath.POSITION_MASK, forward_batch)
        self._semblend_active = info
        try:
            return forward_extend(self, q, k, v, layer, forward_batch, *args, **kw)
        finally:
            self._semblend_active = None

    def forward_extend_hook(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        # A batch holding a sparse request always runs query-only: SGLang's SDPA extend loops
        # over sequences, so the split view is slower (docs/perf.md, "Split view on the CPU
        # server: torch_native").
        if _every_extend or is_sparse_batch(forward_batch):
            return query_only(self, q, k, v, layer, forward_batch, *args, **kw)
        return forward_extend(self, q, k, v, layer, forward_batch, *args, **kw)

    def run_sdpa_hook(
        self: Any,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        active = getattr(self, "_semblend_active", None)
        eligible = (
            active is not None
            and causal
            and not is_cross_attn
            and encoder_lens is None
            and (sliding_window_size is None or sliding_window_size < 0)
            and not getattr(self, "use_sliding_window_kv_pool", False)
        )
        if eligible:
            return extend_attention_query_only(
                query,
                k_cache,
                v_cache,
                output,
                req_to_token,
                req_pool_indices,
                seq_lens,
                extend_seq_lens,
                active[0],
                scaling=scaling,
                enable_gqa=enable_gqa,
                causal=True,
            )
        if active is not None and active[1]:
            raise SparseExtendUnsupported(
                "torch_native: sparse extend on a cross, encoder-only or sliding-window layer"
            )
        return run_sdpa(
            self,
            query,
            output,
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices,
            seq_lens,
            extend_prefix_lens,
            extend_seq_lens,
            encoder_lens,
            scaling=scaling,
            enable_gqa=enable_gqa,
            causal=causal,
            is_cross_attn=is_cross_attn,
            sliding_window_size=sliding_window_size,
        )

    return {
        (native, "forward_extend"): forward_extend_hook,
        (native, "_run_sdpa_forward_extend"): run_sdpa_hook,
    }


# ------------------------------------------------------------------------------------ triton
def _triton_supported(backend: Any) -> bool:
    swa = getattr(backend, "sliding_window_size", None)
    return (
        getattr(backend, "dcp_size", 1) == 1
        and not getattr(backend, "enable_deterministic", False)
        and getattr(backend, "dllm_attention", None) is None
        and not getattr(backend, "use_mla", False)
        and (swa is None or swa <= 0)
        and not getattr(backend, "use_sliding_window_kv_pool", False)
    )


TRITON_SCRATCH = ("kv_indptr", "qo_indptr", "mask_indptr")
"""TritonAttnBackend's per-sequence buffers sized by the request pool (``max_bs + 1``)."""


def _mask_metadata(backend: Any, forward_batch: Any) -> None:
    """Replace the extend metadata SGLang just built for the real batch with the position-mask
    metadata (:func:`build_sparse_extend_metadata`)."""
    info = query_positions(forward_batch)
    if info is None:
        raise SparseExtendUnsupported("triton: sparse extend without query positions")
    md = build_sparse_extend_metadata(
        backend.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        forward_batch.extend_seq_lens,
        info[0],
    )
    meta = backend.forward_metadata
    backend.forward_metadata = dataclasses.replace(
        meta,
        qo_indptr=md.qo_indptr.to(meta.qo_indptr.dtype),
        kv_indptr=md.kv_indptr.to(meta.kv_indptr.dtype),
        kv_indices=md.kv_indices,
        custom_mask=md.custom_mask,
        mask_indptr=md.mask_indptr,
        max_extend_len=md.max_extend_len,
    )


def _split_chosen(forward_batch: Any, seqs: Any) -> bool:
    """triton: attend this sparse batch as its split view (else with the position mask): as
    :func:`set_sparse_path` pinned it, or by :func:`split_is_cheaper` under ``auto``."""
    if _sparse_path == "auto":
        return split_is_cheaper(forward_batch, seqs)
    return _sparse_path == SparsePath.SPLIT_VIEW.value


def _triton_build(
    init_metadata: Callable[[Any, Any], Any], backend: Any, forward_batch: Any, view: Any
) -> tuple[Any, SparsePath]:
    """triton's metadata for a sparse batch: SGLang's over the split view (its scratch buffers
    roomy enough) when chosen, else SGLang's for the real batch replaced by the mask's."""
    seqs = split_view_of(forward_batch).sequences
    if seqs is not None and _split_chosen(forward_batch, seqs):
        with scratch_room(backend, TRITON_SCRATCH, view.batch_size + 1):
            return init_metadata(backend, view), SparsePath.SPLIT_VIEW
    result = init_metadata(backend, forward_batch)
    _mask_metadata(backend, forward_batch)
    return result, SparsePath.POSITION_MASK


def _masked(backend: Any) -> bool:
    """The backend's current metadata is the position mask's (built by :func:`_triton_build`)."""
    return getattr(backend, BUILT_ATTR, None) is backend.forward_metadata


def _triton_extend(backend: Any, forward_batch: Any, view: Any, kw: dict[str, Any]) -> Any:
    return forward_batch if _masked(backend) else view


def _triton_kernel_wrapper(triton_cls: type) -> Wrappers:
    run_kernel = triton_cls._forward_extend_kernel

    def forward_extend_kernel_hook(self: Any, layer: Any, *args: Any, **kw: Any) -> Any:
        if _masked(self):
            kw["skip_prefix_custom_mask"] = SKIP_PREFIX_CUSTOM_MASK
        return run_kernel(self, layer, *args, **kw)

    return {(triton_cls, "_forward_extend_kernel"): forward_extend_kernel_hook}


def _triton_wrappers(triton_cls: type) -> Wrappers:
    difference = SplitDifference(
        _triton_supported, _triton_build, _triton_extend, _triton_kernel_wrapper
    )
    return split_view_wrappers("triton", triton_cls, difference)


# ------------------------------------------------------------------------ install / remove
@dataclasses.dataclass(frozen=True)
class HookedBackend:
    """One SGLang attention backend class the sparse-extend hooks serve: where it lives, the
    wrappers of its methods (built from the current originals), and whether an instance can carry
    a sparse extend with the hooks installed (every page size SGLang allows)."""

    module: str
    cls: str
    wrappers: Callable[[type], dict[tuple[type, str], Any]]
    supported: Callable[[Any], bool]


def _hooked_backends() -> dict[str, HookedBackend]:
    from .attention_fa3 import fa3_supported, fa3_wrappers
    from .attention_flashinfer import (
        flashinfer_supported,
        flashinfer_wrappers,
        trtllm_mha_supported,
        trtllm_mha_wrappers,
    )

    return {
        "torch_native": HookedBackend(
            "sglang.srt.layers.attention.torch_native_backend",
            "TorchNativeAttnBackend",
            _torch_native_wrappers,
            lambda b: not getattr(b, "use_sliding_window_kv_pool", False),
        ),
        "triton": HookedBackend(
            "sglang.srt.layers.attention.triton_backend",
            "TritonAttnBackend",
            _triton_wrappers,
            _triton_supported,
        ),
        "fa3": HookedBackend(
            "sglang.srt.layers.attention.flashattention_backend",
            "FlashAttentionBackend",
            fa3_wrappers,
            fa3_supported,
        ),
        "flashinfer": HookedBackend(
            "sglang.srt.layers.attention.flashinfer_backend",
            "FlashInferAttnBackend",
            flashinfer_wrappers,
            flashinfer_supported,
        ),
        "trtllm_mha": HookedBackend(
            "sglang.srt.layers.attention.trtllm_mha_backend",
            "TRTLLMHAAttnBackend",
            trtllm_mha_wrappers,
            trtllm_mha_supported,
        ),
    }


GPU_BACKENDS = ("triton", "fa3", "flashinfer", "trtllm_mha")
"""Hooked backends besides torch_native; their modules are imported only where they are
installed (:func:`install_attention_hooks`)."""


def _install(name: str) -> bool:
    """Install backend ``name``'s hooks; False when its SGLang module does not import here (then
    no instance of it can exist in this process either)."""
    if name in _originals:
        return True
    entry = _hooked_backends()[name]
    try:
        module = importlib.import_module(entry.module)
    except ImportError as exc:
        logger.debug("semblend: %s hooks not installed (%s)", name, exc)
        return False
    _originals[name] = install_wrappers(entry.wrappers(getattr(module, entry.cls)))
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
        for name in ("torch_native", *GPU_BACKENDS):
            if name in names:
                _install(name)


def remove_attention_hooks() -> None:
    """Restore every method this module replaced, turn ``every_extend`` off and the sparse path
    back to ``auto``; idempotent."""
    global _every_extend
    with _lock:
        for name in list(_originals):
            restore(_originals.pop(name))
        _every_extend = False
    set_sparse_path("auto")


def set_query_only_every_extend(on: bool) -> None:
    """torch_native: run the query-only extend for every extend batch (True), or SGLang's own
    extend with batches holding a sparse request split (False). Takes effect for the next batch;
    hooks must be installed."""
    global _every_extend
    _every_extend = bool(on)


def set_sparse_path(path: str) -> None:
    """Pin how triton attends a batch holding a sparse request: ``auto`` (by tile work),
    ``split_view`` or ``position_mask`` (the ``sparse_path`` setting; the scheduler's start-up
    hook calls it). ValueError on another value. Other backends have one path."""
    global _sparse_path
    if path not in SPARSE_PATHS:
        raise ValueError(f"sparse_path {path!r}: expected one of {SPARSE_PATHS}")
    _sparse_path = path


def query_only_every_extend() -> bool:
    """Whether the torch_native hook runs every extend batch query-only."""
    return _every_extend


def hooks_installed(name: str) -> bool:
    """True while the hooks for backend ``name`` (a key of the hooked backends) are installed."""
    return name in _originals


def sparse_extend_supported(backend: Any) -> bool:
    """True iff ``backend`` (an attention backend instance) runs a sparse extend correctly: its
    class is one of the hooked backends, its hooks are installed, and its own conditions hold
    (torch_native: no sliding-window KV pool; triton: page size 1, no DCP, deterministic mode,
    dLLM, MLA or sliding window; fa3: :func:`.attention_fa3.fa3_supported`). Any other backend
    (hybrid ones included) is False: callers decline such requests as ``unsupported_cache``.
    Never raises.
    """
    try:
        for name, entry in _hooked_backends().items():
            if type(backend).__name__ == entry.cls and hooks_installed(name):
                return bool(entry.supported(backend))
    except Exception:
        return False
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
            ", ".join(sorted(_hooked_backends())),
            Reason.UNSUPPORTED_CACHE,
        )
    return reason


_unsupported_logged = False
