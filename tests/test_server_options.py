"""Server options semantic reuse does not support: named at scheduler start-up, and the runtime
then stays out of every request. Checked with sglang's real ``ServerArgs`` and ``ModelConfig``
and, at cache level, the real cache classes (tests/harness); the real server is in
tests/test_e2e_server_options.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.config import Config
from semblend_sglang.patches.sglang import load_plugin, patch_radix_cache, unpatch_radix_cache
from semblend_sglang.patches.sglang.engine.server_options import unsupported_options
from tests.harness import HarnessConfig, SglangCacheHarness, check_invariants


def _server_args(model_dir: Path, **options: Any) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=str(model_dir), device="cpu", **options)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"disable_radix_cache": True}, "--disable-radix-cache"),
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype fp8_e4m3"),
        ({"disaggregation_mode": "prefill"}, "--disaggregation-mode prefill"),
        ({"pp_size": 2}, "--pp-size 2"),
    ],
)
def test_each_unsupported_option_is_named(
    smollm2_model_dir: Path, options: dict[str, Any], named: str
) -> None:
    found = unsupported_options(_server_args(smollm2_model_dir, **options))
    assert len(found) == 1 and found[0].startswith(named), found


def test_page_size_is_named_only_for_a_version_not_served_paged(smollm2_model_dir: Path) -> None:
    args = _server_args(smollm2_model_dir, page_size=16)
    assert unsupported_options(args) == []
    (line,) = unsupported_options(args, paged=False)
    assert line.startswith("--page-size 16")


def test_the_served_defaults_and_a_plain_model_are_supported(
    smollm2_model_dir: Path, model_config: Any
) -> None:
    args = _server_args(smollm2_model_dir, page_size=1, kv_cache_dtype="auto")
    assert unsupported_options(args, model_config) == []
    assert unsupported_options(_server_args(smollm2_model_dir, kv_cache_dtype="bfloat16")) == []


def test_mla_and_sliding_window_models_are_named(
    smollm2_model_dir: Path, model_config: Any
) -> None:
    from sglang.srt.configs.model_config import AttentionArch

    mla = model_config.__class__.__new__(model_config.__class__)
    mla.__dict__.update(model_config.__dict__, attention_arch=AttentionArch.MLA)
    swa = model_config.__class__.__new__(model_config.__class__)
    swa.__dict__.update(model_config.__dict__, is_hybrid_swa=True)
    args = _server_args(smollm2_model_dir)
    assert [line.split(":")[0] for line in unsupported_options(args, mla)] == ["MLA attention"]
    assert unsupported_options(args, swa)[0].startswith("sliding-window attention")


@pytest.fixture
def refused_adapter() -> Iterator[Any]:
    unpatch_radix_cache()
    adapter = patch_radix_cache(Config(min_prompt_tokens=64, min_reuse_tokens=32))
    assert adapter is not None
    try:
        yield adapter
    finally:
        unpatch_radix_cache()


def test_a_refused_runtime_looks_nothing_up_and_registers_no_donor(
    refused_adapter: Any,
    model_config: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    runtime = refused_adapter.runtime
    with caplog.at_level(logging.WARNING):
        runtime.refuse(["--disable-radix-cache: no exact cache holds donor KV"])
    assert [r.message for r in caplog.records if "unsupported server options" in r.message]
    h = SglangCacheHarness(HarnessConfig(pool_tokens=4096), model_config)
    doc = [t for p in passages[0][:6] for t in p]
    first = h.submit(instructions[0] + doc)
    h.run_until_idle()
    second = h.submit(instructions[1] + doc, max_new_tokens=2)
    h.run_until_idle()
    assert first.finished() and second.finished()
    snap = runtime.snapshot()
    assert snap["lookups"] == 0 and len(runtime.provider.index) == 0, snap
    assert snap["unsupported_options"] == ["--disable-radix-cache: no exact cache holds donor KV"]
    assert snap["reuse_off"] == snap["unsupported_options"]
    check_invariants(h, full_kv=True)


def test_a_bad_setting_under_the_plugin_stops_the_server_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SEMBLEND_ENABLED", "1")
    monkeypatch.setenv("SEMBLEND_MAX_SPANS", "lots")
    monkeypatch.setenv("SEMBLEND_CPU_QUERY_ONLY_EXTEND", "0")
    unpatch_radix_cache()
    with pytest.raises(SystemExit, match="SEMBLEND_MAX_SPANS"):
        load_plugin()
    from semblend_sglang.patches.sglang import installed_adapter

    assert installed_adapter() is None


def _model_config(model_dir: Path, overrides: dict[str, Any]) -> Any:
    """sglang's ModelConfig of ``model_dir`` with ``--json-model-override-args`` applied."""
    import json

    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(
        model_path=str(model_dir), dtype="float32", model_override_args=json.dumps(overrides)
    )


def test_rope_comes_from_the_engines_resolved_config_not_config_json(
    smollm2_model_dir: Path,
) -> None:
    """``--json-model-override-args`` (how Qwen's docs turn YaRN on) changes the RoPE the engine
    runs; config.json still says default. The scheduler wrapper hands the runtime the engine's
    resolved config, so keys are rotated with YaRN's frequencies."""
    from semblend_sglang.patches.sglang.engine.scheduler_hooks import wrap_scheduler_init
    from semblend_sglang.patches.sglang.engine.unified import UnifiedRadixCacheAdapter
    from semblend_sglang.patches.sglang.runtime import SemblendRuntime

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    overrides = {"rope_scaling": yarn, "rope_parameters": {**yarn, "rope_theta": 100000.0}}
    model_config = _model_config(smollm2_model_dir, overrides)
    flow = UnifiedRadixCacheAdapter(Config()).flow
    runtime = flow.runtime

    class FakeSchedulerBuiltElsewhere:  # the real Scheduler needs a model process to build
        def __init__(self) -> None:
            self.server_args = _server_args(smollm2_model_dir)
            self.model_config = model_config

    init = wrap_scheduler_init(FakeSchedulerBuiltElsewhere.__init__, flow)
    init(FakeSchedulerBuiltElsewhere.__new__(FakeSchedulerBuiltElsewhere))
    assert runtime.active
    spec = runtime.rope_spec(str(smollm2_model_dir))
    assert spec is not None and spec.scaling == "yarn" and spec.factor == 4.0
    plain = SemblendRuntime(Config()).rope_spec(str(smollm2_model_dir))  # config.json alone
    assert plain is not None and plain.scaling == "default"


def test_a_model_whose_layers_differ_in_rope_is_refused_at_start_up(
    smollm2_model_dir: Path,
) -> None:
    model_config = _model_config(smollm2_model_dir, {"no_rope_layers": [1] * 29 + [0]})
    found = unsupported_options(_server_args(smollm2_model_dir), model_config)
    assert len(found) == 1 and found[0].startswith("RoPE of the served model: no_rope_layers")


def test_an_attention_backend_that_declines_every_plan_is_named_at_start_up(
    smollm2_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server whose prefill backend cannot run a sparse extend (fa4 here: what SGLang's
    runtime context publishes for ``--attention-backend fa4``) says so once at scheduler
    start-up, and the snapshot's ``reuse_off`` names it; requests are still looked up and
    declined as ``unsupported_cache``."""
    import sglang.srt.runtime_context as runtime_context

    from semblend_sglang.patches.sglang.attention import backends
    from semblend_sglang.patches.sglang.engine.scheduler_hooks import wrap_scheduler_init
    from semblend_sglang.patches.sglang.engine.unified import UnifiedRadixCacheAdapter

    monkeypatch.setattr(runtime_context, "attention_backends", lambda: ("fa4", "fa4"))
    monkeypatch.setattr(backends, "_unsupported_logged", False)
    flow = UnifiedRadixCacheAdapter(Config()).flow
    model_config = _model_config(smollm2_model_dir, {})

    class FakeSchedulerBuiltElsewhere:  # the real Scheduler needs a model process to build
        def __init__(self) -> None:
            self.server_args = _server_args(smollm2_model_dir)
            self.model_config = model_config

    init = wrap_scheduler_init(FakeSchedulerBuiltElsewhere.__init__, flow)
    with caplog.at_level(logging.WARNING):
        init(FakeSchedulerBuiltElsewhere.__new__(FakeSchedulerBuiltElsewhere))
        assert not backends.attention_supported()  # a plan's check: no second line
    (off,) = flow.runtime.snapshot()["reuse_off"]
    assert "fa4" in off, off
    assert flow.runtime.active
    assert len([r for r in caplog.records if "fa4" in r.getMessage()]) == 1


def test_an_unsupported_rope_in_the_engines_config_is_named_in_reuse_off() -> None:
    from transformers import LlamaConfig

    from semblend_sglang.patches.sglang.runtime import SemblendRuntime

    runtime = SemblendRuntime(Config())
    config = LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    runtime.use_model_config(config)
    (off,) = runtime.snapshot()["reuse_off"]
    assert off.startswith("the model's RoPE: ") and "dynamic" in off, off


def test_an_unserved_sglang_version_is_named_by_the_snapshot_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Installed on an sglang no adapter serves (0.5.19 here), the plugin patches nothing, logs
    why once, and ``GET /semblend/snapshot`` on SGLang's real HTTP app answers with that
    reason in ``reuse_off`` instead of asking the schedulers."""
    from packaging.version import Version
    from sglang.srt.entrypoints import http_server
    from starlette.testclient import TestClient

    import semblend_sglang.patches.sglang as plugin
    from semblend_sglang.patches.sglang.engine.http_routes import SNAPSHOT_PATH

    monkeypatch.setenv("SEMBLEND_ENABLED", "1")
    monkeypatch.setenv("SEMBLEND_CPU_QUERY_ONLY_EXTEND", "0")
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: Version("0.5.19"))
    unpatch_radix_cache()
    routes = list(http_server.app.router.routes)
    http_server.app.router.routes[:] = [
        r for r in routes if getattr(r, "path", None) != SNAPSHOT_PATH
    ]
    try:
        plugin.load_plugin()
        assert plugin.installed_adapter() is None
        answer = TestClient(http_server.app).get(SNAPSHOT_PATH)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        (off,) = body["reuse_off"]
        assert "sglang 0.5.19 is not supported" in off and body["ranks"] == [], body
    finally:
        http_server.app.router.routes[:] = routes
