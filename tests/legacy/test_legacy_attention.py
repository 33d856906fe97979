"""The attention side of the one-pass sparse extend on legacy sglang (0.5.15 - 0.5.18).

The legacy adapter installs patches/sglang/attention/backends.py's torch_native hooks (not triton's:
the split view's triton hooks are tested against 0.5.23's `TritonAttnBackend` only). Here the
installed legacy sglang's real `TorchNativeAttnBackend.forward_extend`, with the hooks the adapter
installs, runs random batches mixing sparse, exact-hit and cold requests
(tests/sparse_extend_batches.py) and must equal the dense float64 reference with an explicit
position mask (`extend_attention_reference`); ordinary batches must equal the backend's own unhooked
path. Skipped unless the installed sglang is a legacy version (`make test-legacy`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.versions import legacy_skip_reason, use_triton_interpreter

_SKIP = legacy_skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)
use_triton_interpreter()

import torch  # noqa: E402

from semblend_sglang.config import Config  # noqa: E402
from semblend_sglang.patches.sglang import (  # noqa: E402
    patch_radix_cache,
    unpatch_radix_cache,
)
from semblend_sglang.patches.sglang.attention import backends  # noqa: E402
from semblend_sglang.patches.sglang.attention.split_view import is_sparse_batch  # noqa: E402
from semblend_sglang.patches.sglang.engine.legacy import LegacyRadixCacheAdapter  # noqa: E402
from tests.harness.attention_backend import ATOL, forward, forward_batch, reference  # noqa: E402
from tests.sparse_extend_batches import random_batch  # noqa: E402


@pytest.fixture
def legacy_adapter() -> Iterator[Any]:
    unpatch_radix_cache()
    backends.remove_attention_hooks()
    adapter = patch_radix_cache(Config())
    assert isinstance(adapter, LegacyRadixCacheAdapter)
    try:
        yield adapter
    finally:
        unpatch_radix_cache()


def test_the_legacy_adapter_installs_and_removes_the_torch_native_hooks_only() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    unpatch_radix_cache()
    backends.remove_attention_hooks()
    shipped = TorchNativeAttnBackend.forward_extend
    patch_radix_cache(Config())
    try:
        assert backends.hooks_installed("torch_native")
        assert not backends.hooks_installed("triton")
        native = object.__new__(TorchNativeAttnBackend)
        native.use_sliding_window_kv_pool = False
        assert backends.sparse_extend_supported(native)
        triton = object.__new__(TritonAttnBackend)
        assert not backends.sparse_extend_supported(triton)  # plans declined, not miscomputed
    finally:
        unpatch_radix_cache()
    assert not backends.hooks_installed("torch_native")
    assert TorchNativeAttnBackend.forward_extend is shipped


@pytest.mark.parametrize("seed", range(6))
def test_sparse_batches_equal_the_dense_reference(legacy_adapter: Any, seed: int) -> None:
    heads = [(6, 2), (4, 4), (8, 1), (6, 3), (9, 3), (2, 2)][seed]
    batch = random_batch(100 + seed, n_requests=5, heads=heads)
    assert is_sparse_batch(forward_batch(batch))
    torch.testing.assert_close(forward(batch), reference(batch), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_ordinary_batches_keep_sglangs_own_result(legacy_adapter: Any, seed: int) -> None:
    batch = random_batch(200 + seed, n_requests=4, kinds=("cold", "exact"))
    assert not is_sparse_batch(forward_batch(batch))
    hooked = forward(batch)
    backends.remove_attention_hooks()
    torch.testing.assert_close(hooked, forward(batch), atol=0, rtol=0)
    torch.testing.assert_close(hooked, reference(batch), atol=ATOL, rtol=0)
