"""Worker-side half of the vLLM connector: runs the scheduler's load jobs on the paged KV cache.

Runs in each vLLM worker, called only by :class:`SemBlendConnector`'s worker methods, before
the model's forward (``start_load_kv``). A job copies donor KV into the recipient's own blocks
in every layer with :func:`semblend_sglang.kernels.transfer_kv_paged` (keys RoPE-corrected by
the position shift): Triton on CUDA, torch on CPU. It never raises into vLLM: a job that cannot
run goes to the connector's error handler (counted, logged once), and its target blocks are
reported through
``get_block_ids_with_load_errors`` so that vLLM (``kv_load_failure_policy: recompute``)
recomputes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from semblend_sglang.kernels import RopeSpec, transfer_kv_paged

from .metadata import SemBlendConnectorMetadata

logger = logging.getLogger(__name__)

PACKED_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"})
"""vLLM 0.32 attention backends that read K and V as the halves of the packed last axis."""
CPU_BACKENDS = frozenset({"CPU_ATTN"})
"""vLLM 0.32 attention backends that read each (block, head) page as keys, then values."""


def layout_for_backends(names: set[str]) -> str | None:
    """The kernel layout for a set of attention backend names (None: not supported)."""
    if names and names <= CPU_BACKENDS:
        return "vllm_cpu"
    if names and names <= PACKED_BACKENDS:
        return "vllm_packed"
    return None


def detect_layout(vllm_config: Any) -> tuple[str | None, str]:
    """(layout, how it was found) from the attention layers vLLM registered, or, when there are
    none (a config without a model), from the configured device: on a CPU device vLLM runs its
    CPU attention backend."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
        names = {layer.get_attn_backend().get_name() for layer in layers.values()}
    except Exception:
        names = set()
    if names:
        return layout_for_backends(names), "attention backends " + ", ".join(sorted(names))
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device == "cpu":
        return "vllm_cpu", "device cpu, no attention layers"
    return None, f"device {device!r} with no attention layers"


class WorkerSide:
    """Holds one worker's KV-cache tensors and applies load jobs to them.

    ``layout``: ``auto`` or a kernel layout name (``vllm_packed``, ``vllm_cpu``). ``spec``:
    the model's RoPE (None: every job fails). ``on_error(where, exc)`` receives each failed
    job's exception (the connector counts and logs it once).
    """

    def __init__(
        self,
        vllm_config: Any,
        *,
        block_size: int,
        layout: str,
        spec: RopeSpec | None,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.vllm_config = vllm_config
        self.block_size = block_size
        self.layout_setting = layout
        self.layout: str | None = None
        self.spec = spec
        self.caches: list[torch.Tensor] = []
        self.failed_blocks: set[int] = set()
        self.loaded_tokens = 0
        self.failed_jobs = 0
        self.on_error = on_error
        self.model_hook_seen = False
        """True once a worker-init hook handed over the live model's rotary module."""

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer cache tensors (one entry per distinct tensor) and settle the
        layout."""
        seen: set[int] = set()
        self.caches = []
        for name in sorted(kv_caches):
            t = kv_caches[name]
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                self.caches.append(t)
        how = "kv_cache_layout setting"
        if self.layout_setting == "auto":
            self.layout, how = detect_layout(self.vllm_config)
        else:
            self.layout = self.layout_setting
        if self.layout is None:
            logger.warning("semblend: no supported KV layout (%s); loads will be recomputed", how)
        else:
            logger.info("semblend: worker KV layout %s (%s)", self.layout, how)

    def set_rope_spec(self, spec: RopeSpec) -> None:
        """Replace the RoPE spec (the model hook knows the rotary module's real layout)."""
        self.spec = spec

    def load(self, meta: SemBlendConnectorMetadata) -> None:
        """Run every job of ``meta``; a job that fails marks its target blocks failed."""
        for job in meta.loads:
            try:
                if job.failed:
                    raise RuntimeError("the scheduler could not plan this load")
                if self.spec is None or self.layout is None or not self.caches:
                    raise RuntimeError("no KV caches, layout or RoPE spec on this worker")
                src, dst = job.slots(self.block_size)
                device = self.caches[0].device
                transfer_kv_paged(
                    self.caches,
                    torch.tensor(src, dtype=torch.int64, device=device),
                    torch.tensor(dst, dtype=torch.int64, device=device),
                    torch.full((len(src),), job.delta, dtype=torch.int64, device=device),
                    self.spec,
                    layout=self.layout,  # type: ignore[arg-type]
                    block_size=self.block_size,
                )
                self.loaded_tokens += job.num_tokens
            except Exception as exc:
                self.failed_jobs += 1
                self.failed_blocks |= job.target_blocks_written(self.block_size)
                self.on_error("load", exc)

    def take_failed_blocks(self) -> set[int]:
        """Target blocks of failed jobs since the last call (vLLM recomputes them)."""
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed
