"""transfer_cpu, the CPU fast path of transfer_kv_*: bit for bit equal to the torch reference in
every layout, dtype and RoPE style, and the path dispatch takes on CPU with backend="auto"."""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from semblend_sglang.kernels import (
    RopeSpec,
    SlotOverlapError,
    dispatch,
    transfer_cpu,
    transfer_kv_paged,
    transfer_kv_sglang,
)
from semblend_sglang.kernels.transfer_cpu import wide_rows

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Case:
    layout: str  # "sglang", "flash_attn" or "flashinfer"
    hnd: bool  # paged layouts: heads before block positions in memory
    dtype: torch.dtype  # FP8: e4m3 codes stored as uint8 (fp8_storage: as float8_e4m3fn)
    heads: int
    head_dim: int
    rotary_dim: int
    neox: bool
    block_size: int
    layers: int
    tokens: int
    blocks: int
    fp8_storage: bool = False


CASES = [
    # SGLang pool (block_size 1): SmolLM2's shape in every float dtype, both styles, partial.
    Case("sglang", False, torch.bfloat16, 3, 64, 64, True, 1, 3, 70, 160),
    Case("sglang", False, torch.float16, 3, 64, 64, True, 1, 2, 70, 160),
    Case("sglang", False, torch.float32, 3, 64, 64, True, 1, 2, 70, 160),
    Case("sglang", False, torch.bfloat16, 8, 128, 128, False, 1, 2, 40, 100),
    Case("sglang", False, torch.float16, 1, 64, 32, True, 1, 2, 33, 80),
    Case("sglang", False, torch.float32, 2, 80, 40, False, 1, 2, 33, 80),
    Case("sglang", False, torch.bfloat16, 5, 96, 48, True, 1, 2, 33, 80),
    Case("sglang", False, FP8, 3, 64, 64, True, 1, 3, 50, 120),
    Case("sglang", False, FP8, 2, 64, 32, False, 1, 2, 50, 120, fp8_storage=True),
    # vLLM paged caches: flat NHD slots, and (block, offset) indexing for HND / FlashInfer.
    Case("flash_attn", False, torch.bfloat16, 4, 64, 64, True, 16, 2, 45, 8),
    Case("flash_attn", False, torch.float16, 2, 128, 64, False, 16, 2, 45, 8),
    Case("flash_attn", True, torch.bfloat16, 2, 128, 128, True, 16, 2, 45, 8),
    Case("flash_attn", True, FP8, 4, 64, 64, False, 16, 2, 41, 8),
    Case("flash_attn", False, FP8, 2, 64, 48, True, 16, 2, 41, 8),
    Case("flashinfer", False, torch.float32, 8, 64, 64, True, 16, 2, 45, 8),
    Case("flashinfer", True, torch.float16, 3, 80, 40, True, 16, 2, 50, 8),
    Case("flashinfer", True, torch.bfloat16, 2, 64, 64, False, 1, 2, 30, 80),
    Case("flashinfer", False, FP8, 4, 64, 64, True, 16, 2, 41, 8),
]


def _case_id(c: Case) -> str:
    dtype = "fp8" if c.dtype == FP8 else str(c.dtype)[6:]
    return (
        f"{c.layout}{'-hnd' if c.hnd else ''}-{dtype}{'-f8store' if c.fp8_storage else ''}-"
        f"h{c.heads}-d{c.head_dim}r{c.rotary_dim}-{'neox' if c.neox else 'gptj'}-bs{c.block_size}"
    )


def _storage(x: torch.Tensor, case: Case) -> torch.Tensor:
    if case.dtype != FP8:
        return x.to(case.dtype)
    codes = x.to(FP8)
    return codes if case.fp8_storage else codes.view(torch.uint8)


def _make_caches(case: Case, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-layer cache tensors in the case's layout; V holds arbitrary bit patterns (NaNs too)."""
    h, d, bs, nb = case.heads, case.head_dim, case.block_size, case.blocks
    out = []
    for _ in range(case.layers):
        if case.layout == "sglang":
            k = _storage(torch.randn(nb * bs, h, d, generator=gen) * 3, case)
            v = torch.randint(0, 256, (nb * bs, h, d * k.element_size()), generator=gen)
            out += [k, v.to(torch.uint8).view(k.dtype)]
            continue
        kv_first = case.layout == "flash_attn"
        phys = (2, nb, h, bs, d) if case.hnd else (2, nb, bs, h, d)
        if not kv_first:
            phys = (nb, 2, *phys[2:])
        t = _storage(torch.randn(*phys, generator=gen) * 3, case)
        out.append(t.permute(0, 1, 3, 2, 4) if case.hnd else t)
    return out


def _run(case: Case, caches: list[torch.Tensor], args: tuple, backend: str) -> None:
    src, dst, deltas, scales = args
    spec = RopeSpec(case.head_dim, case.rotary_dim, 1e4, is_neox_style=case.neox)
    kw = {
        "cache_dtype": FP8 if case.dtype == FP8 else None,
        "k_scales": scales,
        "backend": backend,
    }
    if case.layout == "sglang":
        transfer_kv_sglang(caches[0::2], caches[1::2], src, dst, deltas, spec, **kw)
    else:
        transfer_kv_paged(caches, src, dst, deltas, spec, layout=case.layout, **kw)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _slot_args(case: Case, gen: torch.Generator, index_dtype: torch.dtype) -> tuple:
    n_slots = case.blocks * case.block_size
    perm = torch.randperm(n_slots, generator=gen)
    src, dst = perm[: case.tokens].clone(), perm[case.tokens : 2 * case.tokens].clone()
    src[-1] = src[0]  # one donor slot may feed two recipients
    deltas = torch.randint(-20000, 20000, (case.tokens,), generator=gen)
    deltas[:3] = torch.tensor([0, 1, -1])
    deltas[3] = (1 << 24) - 1  # the largest delta check_slots accepts
    scales = [0.5, 2.0, 0.03][: case.layers] if case.dtype == FP8 else None
    return src.to(index_dtype), dst.to(index_dtype), deltas.to(index_dtype), scales


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fast_path_equals_reference_bit_for_bit(case: Case) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    original = _make_caches(case, gen)
    for index_dtype in (torch.int64, torch.int32):
        args = _slot_args(case, gen, index_dtype)
        fast = [c.clone() for c in original]
        ref = [c.clone() for c in original]
        _run(case, fast, args, "auto")
        _run(case, ref, args, "torch")
        for a, b, c in zip(fast, ref, original, strict=True):
            assert torch.equal(_bits(a), _bits(b))
            assert not torch.equal(_bits(a), _bits(c))  # something was written


def test_fast_path_layers_of_different_word_widths() -> None:
    """Layers at storage offsets that allow different copy widths (16, 8, 2 bytes)."""
    gen = torch.Generator().manual_seed(3)
    spec = RopeSpec(64, 64, 1e4)
    slots, heads, dim = 90, 2, 64
    flat = torch.randn(3 * slots * heads * dim + 16, generator=gen).to(torch.bfloat16)
    layer = slots * heads * dim
    k = [flat[o : o + layer].view(slots, heads, dim) for o in (0, layer + 4, 2 * layer + 9)]
    assert [wide_rows(t).dtype for t in k] == [torch.complex128, torch.int64, torch.bfloat16]
    v = [torch.randn(slots, heads, dim, generator=gen).to(torch.bfloat16) for _ in range(3)]
    src, dst = torch.arange(0, 40), torch.arange(45, 85)
    deltas = torch.randint(-3000, 3000, (40,), generator=gen)
    results = []
    for backend in ("auto", "torch"):
        f, vv = flat.clone(), [t.clone() for t in v]
        kk = [f[t.storage_offset() : t.storage_offset() + layer].view_as(t) for t in k]
        transfer_kv_sglang(kk, vv, src, dst, deltas, spec, backend=backend)
        results.append([f, *vv])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_wide_rows_views_the_same_memory() -> None:
    rows = torch.zeros(10, 3, 64, dtype=torch.bfloat16)
    wide = wide_rows(rows)
    assert wide.dtype == torch.complex128 and wide.shape == (10, 24)
    assert wide.data_ptr() == rows.data_ptr()
    assert wide_rows(torch.zeros(10, 3, 60, dtype=torch.bfloat16)).dtype == torch.int64
    assert wide_rows(torch.zeros(10, 3, 6, dtype=torch.uint8)).dtype == torch.int16
    odd = torch.zeros(10, 3, 5, dtype=torch.uint8)
    assert wide_rows(odd) is odd
    gaps = rows[:, :, :60]
    assert wide_rows(gaps) is gaps  # heads not adjacent: elementwise copy
    hnd = torch.zeros(10, 64, 3, dtype=torch.float16).transpose(1, 2)
    assert wide_rows(hnd) is hnd


def test_empty_transfer_is_a_no_op() -> None:
    k = [torch.randn(8, 2, 64).half()]
    v = [torch.randn(8, 2, 64).half()]
    before = [t.clone() for t in (*k, *v)]
    empty = torch.zeros(0, dtype=torch.int64)
    transfer_kv_sglang(k, v, empty, empty, empty, RopeSpec(64, 64, 1e4))
    assert all(torch.equal(a, b) for a, b in zip(before, (*k, *v), strict=True))


def test_dispatch_runs_fast_path_on_cpu_and_reference_on_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    fast, ref = dispatch.transfer_kv_blocks_cpu, dispatch.transfer_kv_blocks_ref
    monkeypatch.setattr(
        dispatch, "transfer_kv_blocks_cpu", lambda *a: (calls.append("cpu"), fast(*a))
    )
    monkeypatch.setattr(
        dispatch, "transfer_kv_blocks_ref", lambda *a: (calls.append("ref"), ref(*a))
    )
    k = [torch.randn(8, 2, 64).half()]
    v = [torch.randn(8, 2, 64).half()]
    one = torch.tensor([1])
    spec = RopeSpec(64, 64, 1e4)
    transfer_kv_sglang(k, v, one, one + 1, one, spec)
    transfer_kv_sglang(k, v, one, one + 2, one, spec, backend="torch")
    transfer_kv_paged([torch.zeros(2, 2, 4, 2, 64)], one, one + 1, one, spec)
    assert calls == ["cpu", "ref", "cpu"]


def test_fast_path_writes_nothing_when_validation_fails() -> None:
    k = [torch.randn(16, 2, 64).half() for _ in range(2)]
    v = [torch.randn(16, 2, 64).half() for _ in range(2)]
    before = [t.clone() for t in (*k, *v)]
    spec = RopeSpec(64, 64, 1e4)
    with pytest.raises(SlotOverlapError):
        transfer_kv_sglang(
            k, v, torch.tensor([1, 2]), torch.tensor([2, 3]), torch.ones(2).long(), spec
        )
    assert all(torch.equal(a, b) for a, b in zip(before, (*k, *v), strict=True))


def test_scratch_memory_is_kept_per_thread() -> None:
    gen = torch.Generator().manual_seed(5)
    k = [torch.randn(64, 2, 64, generator=gen).bfloat16() for _ in range(2)]
    v = [torch.randn(64, 2, 64, generator=gen).bfloat16() for _ in range(2)]
    src, dst, deltas = torch.arange(20), torch.arange(30, 50), torch.arange(20) * 7 - 50
    spec = RopeSpec(64, 64, 1e4)

    def kept() -> int | None:
        buf = transfer_cpu._SCRATCH.buffer
        return None if buf is None else buf.data_ptr()

    def run(backend: str = "auto") -> list[torch.Tensor]:
        kk, vv = [t.clone() for t in k], [t.clone() for t in v]
        transfer_kv_sglang(kk, vv, src, dst, deltas, spec, backend=backend)
        return kk + vv

    want = run("torch")
    assert all(torch.equal(a, b) for a, b in zip(run(), want, strict=True))
    first = kept()
    assert first is not None
    assert all(torch.equal(a, b) for a, b in zip(run(), want, strict=True))
    assert kept() == first  # the same buffer again: no fresh pages

    in_thread: list[int | None] = []
    thread = threading.Thread(target=lambda: (run(), in_thread.append(kept())))
    thread.start()
    thread.join()
    assert in_thread[0] is not None and in_thread[0] != first and kept() == first


@pytest.mark.parametrize("chunk_elements", [1, 3 * 64 * 7, 3 * 64 * 8 + 5])
def test_chunked_transfer_equals_reference(
    monkeypatch: pytest.MonkeyPatch, chunk_elements: int
) -> None:
    """Chunks of 1 token, of 7 tokens (an uneven last chunk) and of 8 tokens, all layers each."""
    monkeypatch.setattr(transfer_cpu, "CHUNK_ELEMENTS", chunk_elements)
    case = Case("sglang", False, torch.bfloat16, 3, 64, 64, True, 1, 2, 30, 100)
    test_fast_path_equals_reference_bit_for_bit(case)
    paged = replace(case, layout="flashinfer", hnd=True, block_size=16, blocks=8)
    test_fast_path_equals_reference_bit_for_bit(paged)  # (block, offset) indexing


class _TrigCalls(TorchFunctionMode):
    """Records the element count of every torch cos/sin evaluated inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.Tensor.cos, torch.cos, torch.Tensor.sin, torch.sin):
            self.numels.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def test_cos_and_sin_run_once_per_distinct_delta_in_both_paths() -> None:
    """4,096 tokens in two spans (two deltas): the fast path and the reference each evaluate
    cos and sin on 2 x 32 angles, never per token, since MKL's multithreaded cos/sin returned
    other values on a worker thread's rows than on the calling thread's (rotation_cos_sin);
    and the two paths still agree bit for bit."""
    n, spec = 4096, RopeSpec(64, 64, 1e5)
    gen = torch.Generator().manual_seed(11)
    k = [torch.randn(2 * n, 3, 64, generator=gen) for _ in range(2)]
    v = [torch.randn(2 * n, 3, 64, generator=gen) for _ in range(2)]
    src, dst = torch.arange(n), torch.arange(n, 2 * n)
    deltas = torch.cat([torch.full((n // 2,), 11), torch.full((n - n // 2,), -300)])
    results = []
    for backend in ("auto", "torch"):
        kk, vv = [t.clone() for t in k], [t.clone() for t in v]
        with _TrigCalls() as trig:
            transfer_kv_sglang(kk, vv, src, dst, deltas, spec, backend=backend)
        assert trig.numels and max(trig.numels) == 2 * 32, (backend, trig.numels)
        results.append(kk + vv)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
