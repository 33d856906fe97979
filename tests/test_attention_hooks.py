"""The torch_native hooks (patches/sglang/attention/): sglang 0.5.23's real
TorchNativeAttnBackend.forward_extend with the hooks, against its own unhooked path (ordinary
batches) and the dense reference (sparse ones, through the split view or the CPU query-only extend);
the fallbacks, install/remove, sparse_extend_supported and the CPU plugin switch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from semblend_sglang.cpu_runtime import ensure_torchvision_importable
from tests.harness.attention_backend import ATOL, forward, forward_batch, reference
from tests.sparse_extend_batches import random_batch

pytest.importorskip("sglang")
ensure_torchvision_importable()

from sglang.srt.layers.attention.torch_native_backend import (  # noqa: E402
    TorchNativeAttnBackend,
)
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402

from semblend_sglang.patches.sglang.attention import backends, torch_native_backend  # noqa: E402
from semblend_sglang.patches.sglang.attention.hook_kit import SparseExtendUnsupported  # noqa: E402
from semblend_sglang.patches.sglang.attention.split_view import is_sparse_batch  # noqa: E402

SHIPPED_FORWARD_EXTEND = TorchNativeAttnBackend.forward_extend
SHIPPED_RUN_SDPA = TorchNativeAttnBackend._run_sdpa_forward_extend


@pytest.fixture
def hooks() -> Iterator[None]:
    backends.install_attention_hooks(triton=False)
    yield
    backends.remove_attention_hooks()


@pytest.mark.parametrize("seed", range(4))
def test_every_extend_equals_sglang_on_ordinary_batches(hooks: None, seed: int):
    batch = random_batch(
        seed, n_requests=4, heads=[(6, 2), (4, 4)][seed % 2], kinds=("cold", "exact")
    )
    shipped = forward(batch)  # hooks installed, every_extend off: sglang's own path
    backends.set_query_only_every_extend(True)
    torch.testing.assert_close(forward(batch), shipped, atol=ATOL, rtol=0)
    torch.testing.assert_close(shipped, reference(batch), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("every_extend", [False, True])
def test_sparse_batches_equal_the_reference(hooks: None, seed: int, every_extend: bool):
    backends.set_query_only_every_extend(every_extend)
    batch = random_batch(seed, n_requests=5, heads=[(6, 2), (4, 4), (8, 1), (6, 3)][seed])
    assert is_sparse_batch(forward_batch(batch))
    torch.testing.assert_close(forward(batch), reference(batch), atol=ATOL, rtol=0)


def test_a_sparse_batch_runs_query_only_an_ordinary_one_sglangs_sdpa(
    hooks: None, monkeypatch: pytest.MonkeyPatch
):
    """Without the query-only extend for every batch, a sparse batch (a few long runs or many
    short ones) runs the position-masked query-only extend on the real batch, counted once on
    that path; an ordinary batch reaches SGLang's SDPA loop as its own requests."""
    from semblend_sglang.patches.sglang.attention.hook_kit import sparse_batch_counts

    seen: list[list[int]] = []
    masked: list[int] = []
    hooked = TorchNativeAttnBackend._run_sdpa_forward_extend
    real_query_only = torch_native_backend.extend_attention_query_only

    def spy(self: Any, *args: Any, **kw: Any) -> Any:
        seen.append(args[6].tolist())  # seq_lens
        return hooked(self, *args, **kw)

    def query_only_spy(*args: Any, **kw: Any) -> Any:
        masked.append(1)
        return real_query_only(*args, **kw)

    monkeypatch.setattr(TorchNativeAttnBackend, "_run_sdpa_forward_extend", spy)
    monkeypatch.setattr(torch_native_backend, "extend_attention_query_only", query_only_spy)
    counts = sparse_batch_counts()
    few = random_batch(1, n_requests=3, min_len=300, max_len=400, kinds=("sparse_runs",) * 3)
    many = random_batch(3, n_requests=4, kinds=("sparse", "cold", "exact", "sparse_chunk"))
    for n, batch in enumerate((few, many), start=1):
        fb = forward_batch(batch)
        torch.testing.assert_close(forward(batch, fb=fb), reference(batch), atol=ATOL, rtol=0)
        forward(batch, fb=fb)  # a second layer of the same batch: counted once
        assert seen[-1] == batch.seq_lens.tolist() and masked == [1] * (2 * n)
    ordinary = random_batch(4, kinds=("cold", "exact"))
    forward(ordinary)
    assert seen[-1] == ordinary.seq_lens.tolist() and len(masked) == 4
    now = sparse_batch_counts()
    assert now["position_mask"] - counts["position_mask"] == 2
    assert now["split_view"] == counts["split_view"]


def test_ordinary_batches_keep_sglangs_path_unless_every_extend(
    hooks: None, monkeypatch: pytest.MonkeyPatch
):
    calls: list[int] = []
    real = torch_native_backend.extend_attention_query_only

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(torch_native_backend, "extend_attention_query_only", spy)
    ordinary = random_batch(1, kinds=("cold", "exact"))
    forward(ordinary)
    assert calls == []
    backends.set_query_only_every_extend(True)
    forward(ordinary)
    assert calls == [1]


@pytest.mark.parametrize("every_extend", [False, True])
def test_unprovable_layers_keep_sglangs_path_or_refuse(hooks: None, every_extend: bool):
    backends.set_query_only_every_extend(every_extend)
    ordinary = random_batch(2, kinds=("cold", "exact"))
    sparse = random_batch(2)
    # Sliding window: sglang's path for an ordinary batch (its own window mask), refused if sparse.
    backends.remove_attention_hooks()
    shipped = forward(ordinary, sliding_window_size=5)
    backends.install_attention_hooks(triton=False)
    backends.set_query_only_every_extend(every_extend)
    torch.testing.assert_close(forward(ordinary, sliding_window_size=5), shipped, atol=0, rtol=0)
    with pytest.raises(SparseExtendUnsupported):
        forward(sparse, sliding_window_size=5)
    with pytest.raises(SparseExtendUnsupported):
        forward(sparse, attn_type=AttentionType.ENCODER_ONLY)
    with pytest.raises(SparseExtendUnsupported):
        forward(sparse, fb=forward_batch(sparse, positions=None))
    # An ordinary batch needs no positions: its queries sit at [m, n) as in sglang.
    torch.testing.assert_close(
        forward(ordinary, fb=forward_batch(ordinary, positions=None)),
        reference(ordinary),
        atol=ATOL,
        rtol=0,
    )


def test_install_and_remove_restore_sglangs_methods():
    backends.install_attention_hooks()
    try:
        assert TorchNativeAttnBackend.forward_extend is not SHIPPED_FORWARD_EXTEND
        assert backends.hooks_installed("torch_native") and backends.hooks_installed("triton")
        backends.install_attention_hooks()  # idempotent: wraps once
        assert TorchNativeAttnBackend.forward_extend.__wrapped__ is SHIPPED_FORWARD_EXTEND
    finally:
        backends.remove_attention_hooks()
    assert TorchNativeAttnBackend.forward_extend is SHIPPED_FORWARD_EXTEND
    assert TorchNativeAttnBackend._run_sdpa_forward_extend is SHIPPED_RUN_SDPA
    assert "init_forward_metadata" in TritonAttnBackend.__dict__
    assert not backends.hooks_installed("torch_native")


def test_sparse_extend_supported():
    native = object.__new__(TorchNativeAttnBackend)
    native.use_sliding_window_kv_pool = False
    triton = object.__new__(TritonAttnBackend)
    for name, value in [
        ("dcp_size", 1),
        ("enable_deterministic", False),
        ("dllm_attention", None),
        ("use_mla", False),
        ("page_size", 1),
        ("sliding_window_size", None),
        ("use_sliding_window_kv_pool", False),
    ]:
        setattr(triton, name, value)
    assert not backends.sparse_extend_supported(native)  # hooks not installed
    backends.install_attention_hooks()
    try:
        assert backends.sparse_extend_supported(native)
        assert backends.sparse_extend_supported(triton)
        triton.page_size = 16
        assert backends.sparse_extend_supported(triton)
        triton.use_mla = True
        assert not backends.sparse_extend_supported(triton)
        native.use_sliding_window_kv_pool = True
        assert not backends.sparse_extend_supported(native)
        assert not backends.sparse_extend_supported(object())
    finally:
        backends.remove_attention_hooks()


@pytest.mark.parametrize(
    ("env", "applied"),
    [
        ({"SGLANG_USE_CPU_ENGINE": "1"}, True),
        ({"SGLANG_USE_CPU_ENGINE": "1", "SEMBLEND_CPU_QUERY_ONLY_EXTEND": "0"}, False),
        ({"SGLANG_USE_CPU_ENGINE": "1", "SEMBLEND_CPU_QUERY_ONLY_EXTEND": "1"}, True),
        ({}, False),
    ],
)
def test_plugin_applies_the_cpu_switch_without_semblend_enabled(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], applied: bool
):
    from semblend_sglang.patches.sglang import installed_adapter, load_plugin

    for key in ("SGLANG_USE_CPU_ENGINE", "SEMBLEND_CPU_QUERY_ONLY_EXTEND"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SEMBLEND_ENABLED", "0")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        load_plugin()
        assert backends.hooks_installed("torch_native") is applied
        assert torch_native_backend.query_only_every_extend() is applied
        assert installed_adapter() is None  # the radix-cache patch stays off
    finally:
        backends.remove_attention_hooks()
