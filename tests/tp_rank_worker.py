"""One tensor-parallel rank for tests/test_tp_agreement.py: a real process in a real two-rank gloo
group, running the sglang 0.5.23 cache harness (tests/harness) with semblend patched,
the harness cache's attention group set to the gloo world as SGLang's ``CacheInitParams`` sets it
on a TP server. Not a test module.

``python tests/tp_rank_worker.py RANK WORLD PORT INPUT OUTPUT``: INPUT is a JSON file with
``model_dir``, ``donor`` and ``target`` (token lists) and ``scenarios`` (names of
:data:`FAULTS`); OUTPUT receives, per scenario, this rank's extend sizes, the target's outcome
and the runtime's counters, and whether the harness invariants held.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tests.harness


def _kernel_out_of_memory(_adapter: Any, monkeypatch: Any) -> None:
    import torch

    import semblend_sglang.kernels as kernels

    def out_of_memory(*_args: Any, **_kwargs: Any) -> None:
        raise torch.OutOfMemoryError("injected: the K/V copy ran out of memory on this rank")

    monkeypatch.setattr(kernels, "transfer_kv_sglang", out_of_memory)


def _lookup_error(adapter: Any, monkeypatch: Any) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("injected: the donor index failed on this rank")

    monkeypatch.setattr(adapter.runtime.provider, "_decide", broken)


def _rope_unreadable(adapter: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(adapter.flow.support, "rope_spec", lambda: None)


FAULTS: dict[str, Callable[[Any, Any], None] | None] = {
    "healthy": None,
    "kernel_oom": _kernel_out_of_memory,
    "lookup_error": _lookup_error,
    "rope_unreadable": _rope_unreadable,
}
"""Scenario name -> the fault rank 1 (only) suffers."""


def run_scenario(
    name: str, rank: int, group: Any, model_config: Any, donor: list[int], target: list[int]
) -> dict[str, Any]:
    """Run the donor, then the target, on this rank; return what the test compares."""
    import pytest

    from semblend_sglang.config import Config
    from semblend_sglang.patches.sglang import patch_radix_cache, unpatch_radix_cache
    from tests.harness import HarnessConfig, SglangCacheHarness, check_invariants

    config = Config(min_prompt_tokens=64, min_reuse_tokens=32, min_reuse_ratio=0.2)
    unpatch_radix_cache()
    adapter = patch_radix_cache(config)
    assert adapter is not None
    with pytest.MonkeyPatch.context() as mp:
        fault = FAULTS[name]
        if rank == 1 and fault is not None:
            fault(adapter, mp)
        h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
        h.cache.attn_tp_group = group  # what CacheInitParams.attn_tp_cache_group sets on TP
        extends: list[int] = []
        forward = h._forward_extend

        def recording(batch: Any) -> None:
            extends.append(int(batch.extend_num_tokens))
            forward(batch)

        mp.setattr(h, "_forward_extend", recording)
        h.submit(donor)
        h.run_until_idle()
        donor_extends = list(extends)
        extends.clear()
        req = h.submit(target, max_new_tokens=2)
        h.run_until_idle()
        invariants = "ok"
        try:
            check_invariants(h, full_kv=True)
        except AssertionError as exc:
            invariants = str(exc)
        snap = adapter.runtime.snapshot()
    unpatch_radix_cache()
    return {
        "donor_extends": donor_extends,
        "target_extends": extends,
        "finished": bool(req.finished()),
        "outcomes": snap["outcomes"],
        "declined": snap["declined"],
        "errors": snap["errors"],
        "invariants": invariants,
    }


def main() -> None:
    """Join the gloo group, run every scenario of INPUT, write OUTPUT."""
    rank, world, port = (int(x) for x in sys.argv[1:4])
    spec = json.loads(Path(sys.argv[4]).read_text())
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()  # as tests/conftest.py does, before sglang is imported
    import torch.distributed as dist
    from sglang.srt.configs.model_config import ModelConfig

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model_config = ModelConfig(model_path=spec["model_dir"], dtype="float32")
    out = {
        name: run_scenario(
            name, rank, dist.group.WORLD, model_config, spec["donor"], spec["target"]
        )
        for name in spec["scenarios"]
    }
    Path(sys.argv[5]).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
