"""transfer_kv_*: Triton kernel (under TRITON_INTERPRET=1) against the torch reference, slot
addressing of every layout, fp8 exactness, and the overlap guard."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from kernels_real_keys import real_keys
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from semblend_sglang.kernels import (
    RopeSpec,
    SlotOverlapError,
    transfer_kv_paged,
    transfer_kv_sglang,
)
from semblend_sglang.kernels.rotate_ref import rotate_fp32
from semblend_sglang.kernels.transfer_ref import dequantize_fp8, quantize_fp8

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton path runs on CPU tensors only under the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Case:
    layout: str  # "sglang", "flash_attn", "flashinfer", "vllm_packed" or "vllm_cpu"
    hnd: bool  # paged layouts: heads before block positions in memory
    dtype: torch.dtype
    heads: int
    head_dim: int
    rotary_dim: int
    neox: bool
    block_size: int
    layers: int
    tokens: int
    blocks: int


CASES = [
    Case("sglang", False, torch.float16, 8, 128, 128, True, 1, 3, 40, 128),
    Case("sglang", False, torch.bfloat16, 3, 64, 64, True, 1, 2, 33, 100),
    Case("sglang", False, torch.float32, 1, 64, 32, False, 1, 2, 21, 64),
    Case("sglang", False, FP8, 2, 64, 64, True, 1, 3, 30, 80),
    Case("flash_attn", False, torch.bfloat16, 4, 64, 64, True, 16, 2, 37, 8),
    Case("flash_attn", True, torch.float16, 2, 128, 128, False, 16, 2, 29, 6),
    Case("flash_attn", False, FP8, 2, 64, 32, False, 1, 2, 25, 64),
    Case("flashinfer", False, torch.float32, 8, 64, 64, True, 64, 2, 45, 3),
    Case("flashinfer", True, torch.bfloat16, 3, 80, 40, True, 64, 2, 50, 3),
    Case("flashinfer", False, torch.float16, 5, 64, 48, False, 1, 3, 31, 80),
    Case("flashinfer", True, FP8, 4, 64, 64, True, 16, 2, 41, 8),
    # vLLM 0.32's packed per-layer view [blocks, heads, block_size, 2 * head_dim].
    Case("vllm_packed", True, torch.bfloat16, 3, 64, 64, True, 16, 2, 37, 8),
    Case("vllm_packed", False, torch.float16, 2, 128, 128, True, 32, 2, 45, 4),
    Case("vllm_packed", False, FP8, 2, 64, 64, False, 16, 2, 30, 6),
    Case("vllm_cpu", True, torch.float32, 3, 64, 64, True, 32, 3, 50, 4),
    Case("vllm_cpu", True, torch.bfloat16, 2, 128, 64, True, 32, 2, 40, 4),
]


def _storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(FP8).view(torch.uint8) if dtype == FP8 else x.to(dtype)


def _make_caches(case: Case, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-layer cache tensors in the case's layout, filled with random values."""
    h, d, bs, nb = case.heads, case.head_dim, case.block_size, case.blocks
    out = []
    for _ in range(case.layers):
        if case.layout == "sglang":
            for _kv in range(2):
                out.append(_storage(torch.randn(nb * bs, h, d, generator=gen) * 3, case.dtype))
            continue
        if case.layout in ("vllm_packed", "vllm_cpu"):
            # Logical [blocks, heads, block, 2 * dim]; memory LBHNC (hnd) or LBNHC.
            phys = (nb, h, bs, 2 * d) if case.hnd else (nb, bs, h, 2 * d)
            t = _storage(torch.randn(*phys, generator=gen) * 3, case.dtype)
            out.append(t if case.hnd else t.permute(0, 2, 1, 3))
            continue
        kv_first = case.layout == "flash_attn"
        phys = (2, nb, h, bs, d) if kv_first else (nb, 2, h, bs, d)
        if not case.hnd:
            phys = (2, nb, bs, h, d) if kv_first else (nb, 2, bs, h, d)
        t = _storage(torch.randn(*phys, generator=gen) * 3, case.dtype)
        out.append(t.permute(0, 1, 3, 2, 4) if case.hnd else t)
    return out


def _run(
    case: Case,
    caches: list[torch.Tensor],
    src: Any,
    dst: Any,
    deltas: Any,
    backend: str,
    scales: list[float] | None,
) -> None:
    spec = RopeSpec(case.head_dim, case.rotary_dim, 1e4, is_neox_style=case.neox)
    cache_dtype = FP8 if case.dtype == FP8 else None
    if case.layout == "sglang":
        transfer_kv_sglang(
            caches[0::2],
            caches[1::2],
            src,
            dst,
            deltas,
            spec,
            cache_dtype=cache_dtype,
            k_scales=scales,
            backend=backend,
        )
    else:
        transfer_kv_paged(
            caches,
            src,
            dst,
            deltas,
            spec,
            layout=case.layout,
            block_size=case.block_size,
            cache_dtype=cache_dtype,
            k_scales=scales,
            backend=backend,
        )


def _k_v(case: Case, cache: list[torch.Tensor], layer: int, slot: int) -> tuple[torch.Tensor, ...]:
    """K and V rows [heads, dim] of one slot, indexed straight from the layout's definition."""
    b, o = divmod(slot, case.block_size)
    if case.layout == "sglang":
        return cache[2 * layer][slot], cache[2 * layer + 1][slot]
    kv = cache[layer]
    d = case.head_dim
    if case.layout == "vllm_packed":  # GPU backends: kv.transpose(1, 2).split(head_size, -1)
        return kv[b, :, o, :d], kv[b, :, o, d:]
    if case.layout == "vllm_cpu":  # CPU backend: kv.view(B, H, 2 * bs, d).chunk(2, dim=2)
        page = kv[b].reshape(case.heads, 2 * case.block_size, d)
        return page[:, o], page[:, case.block_size + o]
    if case.layout == "flash_attn":
        return kv[0, b, o], kv[1, b, o]
    return kv[b, 0, o], kv[b, 1, o]


def _pair_norm(x: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Per element, the magnitude of its rotation pair (|x| for unrotated dims)."""
    out = x.abs().clone()
    r, half = spec.rotary_dim, spec.rotary_dim // 2
    if spec.is_neox_style:
        a, b = x[..., :half], x[..., half:r]
        norm = torch.sqrt(a * a + b * b)
        out[..., :half], out[..., half:r] = norm, norm
    else:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        norm = torch.sqrt(a * a + b * b)
        out[..., 0:r:2], out[..., 1:r:2] = norm, norm
    return out


def _as_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.view(FP8).float() if dtype == FP8 else x.float()


CASE_IDS = [
    f"{c.layout}{'-hnd' if c.hnd else ''}-{str(c.dtype)[6:]}-h{c.heads}-d{c.head_dim}"
    f"r{c.rotary_dim}-{'neox' if c.neox else 'gptj'}-bs{c.block_size}"
    for c in CASES
]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_equals_reference(case: Case) -> None:
    assert_kernel_equals_reference(case, torch.device("cpu"))


def assert_kernel_equals_reference(case: Case, device: torch.device) -> None:
    """The Triton kernel and the torch reference move the same slots of ``case``'s layout on
    ``device`` (CPU: under the interpreter; CUDA: compiled) and write nothing else; the
    reference equals R(delta) of the donor's K and copies V bit for bit."""
    # A stable seed per case (Python's hash() of the case differs per process).
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    original = [c.to(device) for c in _make_caches(case, gen)]
    n_slots = case.blocks * case.block_size
    perm = torch.randperm(n_slots, generator=gen)
    src, dst = perm[: case.tokens].clone(), perm[case.tokens : 2 * case.tokens].clone()
    src[-1] = src[0]  # one donor slot feeding two recipients is allowed
    deltas = torch.randint(-5000, 5000, (case.tokens,), generator=gen)
    deltas[:3] = 0
    scales = [0.5, 2.0, 1.0][: case.layers] if case.dtype == FP8 else None
    by_kernel = [c.clone() for c in original]
    by_ref = [c.clone() for c in original]
    on_device = src.to(device), dst.to(device), deltas.to(device)
    _run(case, by_kernel, *on_device, "triton", scales)
    _run(case, by_ref, *on_device, "torch", scales)
    # Compared on the CPU, slot by slot.
    original, by_kernel, by_ref = ([c.cpu() for c in t] for t in (original, by_kernel, by_ref))

    spec = RopeSpec(case.head_dim, case.rotary_dim, 1e4, is_neox_style=case.neox)
    r = case.rotary_dim
    eps = 2.0**-3 if case.dtype == FP8 else torch.finfo(case.dtype).eps
    dst_set = set(dst.tolist())
    for layer in range(case.layers):
        scale = scales[layer] if scales else 1.0
        for slot in range(n_slots):
            k_kern, v_kern = _k_v(case, by_kernel, layer, slot)
            k_ref, v_ref = _k_v(case, by_ref, layer, slot)
            k_old, v_old = _k_v(case, original, layer, slot)
            if slot not in dst_set:  # nothing else is written
                assert torch.equal(k_kern, k_old) and torch.equal(v_kern, v_old)
                assert torch.equal(k_ref, k_old) and torch.equal(v_ref, v_old)
                continue
            i = dst.tolist().index(slot)
            k_src, v_src = _k_v(case, original, layer, int(src[i]))
            assert torch.equal(v_kern, v_src) and torch.equal(v_ref, v_src)
            assert torch.equal(k_kern[:, r:], k_src[:, r:])
            assert torch.equal(k_ref[:, r:], k_src[:, r:])
            if deltas[i] == 0:  # compared as values: rotating -0.0 by 0 may give +0.0
                k_src_values = _as_float(k_src, case.dtype)
                assert torch.equal(_as_float(k_kern, case.dtype), k_src_values)
                assert torch.equal(_as_float(k_ref, case.dtype), k_src_values)
            # The reference is R(delta) applied to the donor's dequantized K.
            want = rotate_fp32(_as_float(k_src, case.dtype)[None] * scale, deltas[i : i + 1], spec)[
                0
            ]
            got_ref = _as_float(k_ref, case.dtype) * scale
            got_kern = _as_float(k_kern, case.dtype) * scale
            floor = 2.0**-9 * scale if case.dtype == FP8 else 1e-6
            tol = 2 * eps * _pair_norm(want, spec) + floor
            assert ((got_ref - want).abs() <= tol).all()
            # Kernel and reference round the same fp32 rotation (cos/sin may differ in the
            # last fp32 bit): within one step of the output dtype of the pair's magnitude.
            assert ((got_kern - got_ref).abs() <= tol).all()


def _sglang_case_caches(n_slots: int = 32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return (
        [torch.randn(n_slots, 2, 64, generator=gen).half() for _ in range(2)],
        [torch.randn(n_slots, 2, 64, generator=gen).half() for _ in range(2)],
    )


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize(
    ("src", "dst", "error", "needle"),
    [
        ([1, 2, 3], [3, 4, 5], SlotOverlapError, "overlap"),
        ([1, 2, 3], [4, 4, 5], SlotOverlapError, "more than once"),
        ([1, 2, 3], [4, 5, 32], ValueError, "out of range"),
        ([-1, 2, 3], [4, 5, 6], ValueError, "out of range"),
    ],
)
def test_bad_slots_raise_before_writing(
    backend: str, src: list[int], dst: list[int], error: type[Exception], needle: str
) -> None:
    k, v = _sglang_case_caches()
    before = [t.clone() for t in (*k, *v)]
    spec = RopeSpec(64, 64, 1e4)
    with pytest.raises(error, match=needle):
        transfer_kv_sglang(
            k,
            v,
            torch.tensor(src),
            torch.tensor(dst),
            torch.tensor([5, 0, -5]),
            spec,
            backend=backend,
        )  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, (*k, *v), strict=True))


def test_bad_layout_arguments_raise() -> None:
    spec = RopeSpec(64, 64, 1e4)
    kv = torch.zeros(2, 4, 16, 2, 64, dtype=torch.float16)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="block_size 16 != 32"):
        transfer_kv_paged([kv], one, one + 1, one, spec, layout="flash_attn", block_size=32)
    with pytest.raises(ValueError, match="flashinfer"):
        transfer_kv_paged([kv], one, one + 1, one, spec, layout="flashinfer")
    with pytest.raises(ValueError, match="head_dim"):
        transfer_kv_paged([kv], one, one + 1, one, RopeSpec(128, 128, 1e4))
    packed = torch.zeros(4, 2, 16, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="LBHNC"):
        transfer_kv_paged(
            [packed.transpose(1, 2).contiguous().transpose(1, 2)],
            one,
            one + 1,
            one,
            spec,
            layout="vllm_cpu",
        )
    with pytest.raises(ValueError, match="2 \\* head_size"):
        transfer_kv_paged([kv], one, one + 1, one, spec, layout="vllm_packed")
    k, v = _sglang_case_caches()
    with pytest.raises(ValueError, match="k_scales applies only to an fp8 cache"):
        transfer_kv_sglang(k, v, one, one + 1, one, spec, k_scales=[1.0, 1.0])


def test_fp8_transfer_error_against_cold_quantization(
    smollm2_model_dir: Path, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    """Real keys: K quantized at p, moved by d, vs K computed at p + d and quantized cold.

    Rotating quantized values is not exactly representable: the moved code may differ from the
    cold one. Bounds checked here (measured values in docs/kernels.md): every value within one
    e4m3 step of its pair's magnitude, most codes identical, rms error within 1.5x of cold.
    """
    ids = smollm2_tokenizer(essay_texts[1])["input_ids"][:128]
    keys = real_keys(smollm2_model_dir, ids)
    config = LlamaConfig.from_pretrained(smollm2_model_dir)
    rope = LlamaRotaryEmbedding(config)
    spec = RopeSpec.from_hf_config(config)

    def at(pos: torch.Tensor) -> torch.Tensor:
        x = keys.transpose(0, 1)[None]
        cos, sin = rope(x, pos[None])
        return apply_rotary_pos_emb(x, x, cos, sin)[1][0].transpose(0, 1)

    n = keys.shape[0]
    pos = torch.arange(n) + 200
    deltas = torch.full((n,), 1500)
    scale = float(keys.abs().max()) / 448.0
    k_buf = torch.zeros(2 * n, 3, 64, dtype=torch.uint8)
    v_buf = torch.zeros_like(k_buf)
    k_buf[:n] = quantize_fp8(at(pos), scale)
    for backend in ("torch", "triton"):
        k_run = k_buf.clone()
        transfer_kv_sglang(
            [k_run],
            [v_buf.clone()],
            torch.arange(n),
            torch.arange(n, 2 * n),
            deltas,
            spec,
            cache_dtype=FP8,
            k_scales=[scale],
            backend=backend,
        )
        moved = dequantize_fp8(k_run[n:], scale)
        cold = dequantize_fp8(quantize_fp8(at(pos + deltas), scale), scale)
        same = (k_run[n:] == quantize_fp8(at(pos + deltas), scale)).float().mean().item()
        # One e4m3 step (2**-3 relative) of the pair magnitude, or a subnormal step.
        half = spec.rotary_dim // 2
        pair = torch.sqrt(cold[..., :half] ** 2 + cold[..., half:] ** 2).repeat(1, 1, 2)
        assert ((moved - cold).abs() <= 2.0**-3 * pair + 2.0**-9 * scale).all()
        assert same >= 0.6, f"{backend}: only {same:.1%} of codes equal the cold quantization"
        exact = at(pos + deltas)
        rms_moved = (moved - exact).pow(2).mean().sqrt().item()
        rms_cold = (cold - exact).pow(2).mean().sqrt().item()
        assert rms_moved <= 1.5 * rms_cold, f"{backend}: rms {rms_moved:.4f} vs cold {rms_cold:.4f}"
