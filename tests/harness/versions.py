"""Which sglang the tests run against, and what the adapter-contract suite needs to know about it.

`installed_part()` picks the `VersionPart` of the installed sglang: `UnifiedPart` for 0.5.22+
(`UnifiedRadixCache`, `make test`), `LegacyPart` for 0.5.15 - 0.5.18 (`RadixCache`,
`make test-legacy`). A part names the harness, adapter and tree classes, the measured floors of
the randomized runs, and the few seams whose spelling differs (a request's exact-hit count, the
host-tier fake, the hooked methods). Importing this module imports no sglang module.
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import pytest

from semblend_sglang.patches.sglang.engine.adapter import installed_sglang_version
from semblend_sglang.patches.sglang.engine.legacy import (
    END_VERSION,
    FIRST_VERSION,
    LegacyRadixCacheAdapter,
)
from semblend_sglang.patches.sglang.engine.unified import UnifiedRadixCacheAdapter
from tests.harness.driver import CacheHarness
from tests.harness.hazard import HazardDonorMatch, LegacyHazardDonorMatch, UnifiedHazardDonorMatch
from tests.harness.legacy import LegacyCacheHarness
from tests.harness.unified import SglangCacheHarness


@dataclasses.dataclass(frozen=True)
class VanillaCase:
    """One randomized run of vanilla sglang and the floors it must reach (measured)."""

    backend: str
    page_size: int
    num_requests: int
    min_hits: int
    min_decode_steps: int


class VersionPart(ABC):
    """What differs, for the adapter-contract suite, between the sglang trees semblend serves."""

    name: str
    harness_cls: type[CacheHarness]
    adapter_cls: type[Any]
    hazard_cls: type[HazardDonorMatch]
    tree_module: str
    tree_class: str
    vanilla_cases: tuple[VanillaCase, ...]
    held_donors: bool
    """Whether the adapter keeps a reused request's unpublished prompt KV as held donors."""
    computed_admission: bool
    """Whether SGLang's PrefillAdder charges a sparse request the positions it computes (else
    its raw length, chunk by chunk)."""

    def prepare_process(self) -> None:
        """Run at collection, before any sglang import (default: nothing)."""
        return None

    @abstractmethod
    def check_tree(self, h: CacheHarness, backend: str) -> None:
        """Assert `h` runs the tree (and core `backend`, where there is a choice) expected."""

    @abstractmethod
    def exact_hit(self, req: Any) -> int:
        """Tokens of `req`'s exact prefix hit after its first step."""

    @abstractmethod
    def fake_host_tier(self, monkeypatch: pytest.MonkeyPatch, adapter: Any) -> Callable[[], None]:
        """Make the adapter's donor match report half of each donor's device slots as host
        resident (what HiCache's tree reports for a path evicted to host memory, which needs
        CUDA); returns the function that puts the real match back."""

    @abstractmethod
    def hooked_methods(self) -> list[tuple[type, str]]:
        """(class, name) of methods the adapter wraps that the class itself defines."""


class UnifiedPart(VersionPart):
    """sglang 0.5.22+ (`UnifiedRadixCache`; 0.5.23 in `make test`)."""

    name = "unified"
    harness_cls = SglangCacheHarness
    adapter_cls = UnifiedRadixCacheAdapter
    hazard_cls = UnifiedHazardDonorMatch
    tree_module = "sglang.srt.mem_cache.unified_radix_cache"
    tree_class = "UnifiedRadixCache"
    vanilla_cases = (VanillaCase("rust", 1, 520, 90, 10), VanillaCase("python", 16, 120, 8, 10))
    held_donors = True
    computed_admission = True

    def check_tree(self, h: CacheHarness, backend: str) -> None:
        expected_core = "RustUnifiedTreeCore" if backend == "rust" else "UnifiedTreeCore"
        assert type(h.cache.tree_core).__name__ == expected_core

    def exact_hit(self, req: Any) -> int:
        return int(req.prefix_len)

    def fake_host_tier(self, monkeypatch: pytest.MonkeyPatch, adapter: Any) -> Callable[[], None]:
        view = adapter.flow.view
        real = type(view)._donor_match

        def host_resident(cache: Any, params: Any, orig_match: Any) -> Any:
            found = real(cache, params, orig_match)
            moved = int(found.device_prefix_len) // 2
            return found._replace(
                device_prefix_len=int(found.device_prefix_len) - moved, host_hit_length=moved
            )

        monkeypatch.setattr(view, "_donor_match", host_resident)
        return lambda: monkeypatch.setattr(view, "_donor_match", real)

    def hooked_methods(self) -> list[tuple[type, str]]:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        return [
            (UnifiedRadixCache, "match_prefix"),
            (UnifiedRadixCache, "checkpoint"),
            (UnifiedRadixCache, "on_release"),
            (UnifiedRadixCache, "reset"),
            (ScheduleBatch, "prepare_for_extend"),
            (ForwardBatch, "init_new"),
        ]


class LegacyPart(VersionPart):
    """sglang 0.5.15 - 0.5.18 (`RadixCache`; 0.5.15 in `make test-legacy`)."""

    name = "legacy"
    harness_cls = LegacyCacheHarness
    adapter_cls = LegacyRadixCacheAdapter
    hazard_cls = LegacyHazardDonorMatch
    tree_module = "sglang.srt.mem_cache.radix_cache"
    tree_class = "RadixCache"
    vanilla_cases = (VanillaCase("radix", 1, 520, 90, 10), VanillaCase("radix", 16, 120, 8, 5))
    held_donors = False
    computed_admission = False

    def prepare_process(self) -> None:
        use_triton_interpreter()

    def check_tree(self, h: CacheHarness, backend: str) -> None:
        from sglang.srt.mem_cache.radix_cache import RadixCache

        assert type(h.cache) is RadixCache

    def exact_hit(self, req: Any) -> int:
        return int(req.cached_tokens)

    def fake_host_tier(self, monkeypatch: pytest.MonkeyPatch, adapter: Any) -> Callable[[], None]:
        view_cls = type(adapter.flow.view)
        real = view_cls._donor_match

        def host_resident(self: Any, cache: Any, params: Any) -> Any:
            found = real(self, cache, params)
            on_device = len(found.device_indices)
            moved = on_device // 2
            return found._replace(
                device_indices=found.device_indices[: on_device - moved], host_hit_length=moved
            )

        monkeypatch.setattr(view_cls, "_donor_match", host_resident)
        return lambda: monkeypatch.setattr(view_cls, "_donor_match", real)

    def hooked_methods(self) -> list[tuple[type, str]]:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        return [
            (RadixCache, "match_prefix"),
            (HiRadixCache, "match_prefix"),
            (RadixCache, "cache_unfinished_req"),
            (RadixCache, "cache_finished_req"),
            (ScheduleBatch, "prepare_for_extend"),
            (ForwardBatch, "init_new"),
            (TorchNativeAttnBackend, "forward_extend"),
            (TorchNativeAttnBackend, "_run_sdpa_forward_extend"),
            (Scheduler, "abort_request"),
            (Scheduler, "_add_request_to_queue"),
            (Scheduler, "get_internal_state"),
        ]


def installed_part() -> VersionPart | None:
    """The part of the installed sglang, or None when no adapter serves it (or it is absent)."""
    version = installed_sglang_version()
    if version is None:
        return None
    if UnifiedRadixCacheAdapter.supports(version):
        return UnifiedPart()
    if LegacyRadixCacheAdapter.supports(version):
        return LegacyPart()
    return None


def contract_part() -> VersionPart:
    """The installed version's part for a contract test module, called at its top level: skips
    the module when no adapter serves the installed sglang, and prepares the process."""
    part = installed_part()
    if part is None:
        version = installed_sglang_version()
        pytest.skip(f"no semblend adapter serves sglang {version}", allow_module_level=True)
    part.prepare_process()
    return part


def legacy_skip_reason() -> str | None:
    """None when the installed sglang is served by the legacy adapter, else why tests/legacy
    skips (they run in `make test-legacy`'s .venv-legacy only)."""
    version = installed_sglang_version()
    if version is None:
        return "sglang is not installed"
    if not LegacyRadixCacheAdapter.supports(version):
        return (
            f"installed sglang {version} is not a legacy version "
            f"({FIRST_VERSION} <= v < {END_VERSION}); run `make test-legacy`"
        )
    return None


def use_triton_interpreter() -> None:
    """Make sglang's own Triton kernels run on CPU (Triton's interpreter), for this process.

    0.5.15's `PagedTokenToKVPoolAllocator.alloc_extend` / `alloc_decode` always launch Triton
    kernels (mem_cache/allocator/paged.py), and `triton.jit` picks the interpreter when the
    function is defined, i.e. when sglang's module is imported: so this must run before any test
    imports sglang (module level, at collection). semblend's own kernels stay on their torch
    reference for CPU tensors (kernels/dispatch.py "auto"). The page-size-1 path is unaffected.
    """
    os.environ.setdefault("TRITON_INTERPRET", "1")
