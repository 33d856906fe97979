"""The contract every hooked attention backend keeps (the registry,
patches/sglang/attention/backends.py), checked once per backend on a stand-in class with the
backend's class name: its hooks wrap and restore its methods, an ordinary batch reaches SGLang's
methods untouched, a sparse batch is refused under CUDA-graph metadata and on a configuration the
common refusals or its own reject, and the backend lists are the registry's. What each backend does
with a sparse batch is its own test file's (tests/test_sparse_extend_<name>.py,
tests/test_attention_hooks.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from semblend_sglang.cpu_runtime import ensure_torchvision_importable
from semblend_sglang.patches.sglang.attention import backends
from semblend_sglang.patches.sglang.attention.hook_kit import (
    SparseExtendUnsupported,
    SplitDifference,
)
from semblend_sglang.patches.sglang.wrapping import install_wrappers, restore
from tests.harness.attention_backend import forward_batch
from tests.sparse_extend_batches import random_batch

pytest.importorskip("sglang")
ensure_torchvision_importable()

NAMES = sorted(backends.HOOKED_BACKENDS)
SPLIT = sorted(
    name
    for name, entry in backends.HOOKED_BACKENDS.items()
    if isinstance(entry.difference, SplitDifference)
)
COMMON = [
    ("use_sliding_window_kv_pool", True),
    ("use_mla", True),
    ("kv_index_translator", SimpleNamespace(is_translating=True)),
    ("kv_index_translator", SimpleNamespace(reads_are_translated=True)),
    ("dcp_size", 2),
]


def _standin(name: str) -> type:
    """A class named as backend ``name``'s, with the methods its hooks wrap, each recording the
    batch it was given."""

    def record(method: str) -> Any:
        def call(self: Any, *args: Any, **kw: Any) -> str:
            self.calls.append((method, args))
            return method

        return call

    methods = (
        "init_forward_metadata",
        "init_forward_metadata_out_graph",
        "forward_extend",
        "_forward_extend_kernel",
        "_run_sdpa_forward_extend",
    )
    return type(backends.HOOKED_BACKENDS[name].cls, (), {m: record(m) for m in methods})


def _instance(cls: type, **attrs: Any) -> Any:
    backend = cls()
    backend.calls = []
    for key, value in attrs.items():
        setattr(backend, key, value)
    return backend


def test_the_backend_lists_are_the_registrys():
    assert all(entry.name == name for name, entry in backends.HOOKED_BACKENDS.items())
    assert set(backends.GPU_BACKENDS) == set(NAMES) - {"torch_native"}
    assert not set(backends.UNSERVED_BACKENDS) & set(NAMES)
    for name in NAMES:
        assert backends.backend_reuse_reason(name) is None
    for name in backends.UNSERVED_BACKENDS:
        assert name in str(backends.backend_reuse_reason(name))


@pytest.mark.parametrize("name", NAMES)
def test_hooks_wrap_and_restore_the_backends_methods(name: str):
    entry = backends.HOOKED_BACKENDS[name]
    cls = _standin(name)
    shipped = dict(vars(cls))
    originals = install_wrappers(entry.wrappers(cls, lambda backend: True))
    assert originals and all(vars(cls)[attr] is not shipped[attr] for _, attr in originals)
    restore(originals)
    assert all(vars(cls)[attr] is shipped[attr] for _, attr in originals)


@pytest.mark.parametrize("name", NAMES)
def test_the_common_refusals_hold_for_every_backend(name: str):
    entry = backends.HOOKED_BACKENDS[name]
    cls = _standin(name)
    assert backends.backend_serves(entry, _instance(cls))
    for key, value in COMMON:
        assert not backends.backend_serves(entry, _instance(cls, **{key: value})), key
    backends.install_attention_hooks(triton=False, gpu_backends=())
    try:
        native = backends.sparse_extend_supported(_instance(cls))
        assert native is (name == "torch_native")  # only installed hooks serve
    finally:
        backends.remove_attention_hooks()


@pytest.mark.parametrize("name", SPLIT)
def test_split_view_wrappers_keep_ordinary_batches_and_refuse_what_they_cannot_carry(name: str):
    entry = backends.HOOKED_BACKENDS[name]
    cls = _standin(name)
    install = install_wrappers(entry.wrappers(cls, lambda b: not getattr(b, "refused", False)))
    try:
        ordinary = forward_batch(random_batch(1, n_requests=2, kinds=("cold", "exact")))
        backend = _instance(cls)
        backend.init_forward_metadata_out_graph(ordinary)
        backend.init_forward_metadata(ordinary)
        assert backend.calls == [
            ("init_forward_metadata_out_graph", (ordinary,)),
            ("init_forward_metadata", (ordinary,)),
        ]
        sparse = forward_batch(random_batch(1, n_requests=2, kinds=("sparse", "cold")))
        with pytest.raises(SparseExtendUnsupported, match=f"{name}: sparse extend under a CUDA"):
            backend.init_forward_metadata_out_graph(sparse)
        refused = _instance(cls, refused=True)
        with pytest.raises(SparseExtendUnsupported, match=f"{name}: this backend configuration"):
            refused.init_forward_metadata(sparse)
        assert refused.calls == []
    finally:
        restore(install)


@pytest.mark.parametrize("name", NAMES)
def test_the_wrapped_methods_are_sglangs(name: str):
    """Each method a backend's hooks wrap is one its sglang class has (skipped where the class
    does not import on this machine)."""
    entry = backends.HOOKED_BACKENDS[name]
    real = getattr(pytest.importorskip(entry.module), entry.cls)
    for _, attr in entry.wrappers(_standin(name), lambda backend: True):
        assert callable(getattr(real, attr, None)), attr
