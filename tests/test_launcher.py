"""The launcher's own flags: resolution, precedence, validation, child environment, help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from semblend_sglang.cli import main
from semblend_sglang.config import FIELDS, MODES, Config, ConfigError
from semblend_sglang.launcher import (
    config_environ,
    resolve_config,
    semblend_flags,
    unknown_semblend_flags,
)
from semblend_sglang.patches.sglang.engine.http_routes import merge_snapshots


def test_every_config_field_has_a_launcher_flag() -> None:
    flags = semblend_flags()
    for spec in FIELDS:
        assert spec.flag in flags
    assert "--semblend-config" in flags


def test_precedence_env_then_json_then_flags(tmp_path: Path) -> None:
    env = {
        "SEMBLEND_MIN_REUSE_TOKENS": "200",
        "SEMBLEND_SINK_TOKENS": "2",
        "SEMBLEND_MAX_SPANS": "3",
    }
    cfg_file = tmp_path / "semblend.json"
    cfg_file.write_text(json.dumps({"sink_tokens": 6, "max_spans": 5}))
    config = resolve_config(env, {"--semblend-max-spans": "7"}, "@" + str(cfg_file))
    assert config.min_reuse_tokens == 200  # env only
    assert config.sink_tokens == 6  # JSON over env
    assert config.max_spans == 7  # flag over JSON
    inline = resolve_config({}, {"semblend_sink_tokens": None}, '{"sink_tokens": 9}')
    assert inline.sink_tokens == 9  # a flag not given (None) changes nothing


def test_unset_enabled_means_enabled_and_env_can_disable() -> None:
    assert resolve_config({}, {}).enabled
    assert not resolve_config({"SEMBLEND_ENABLED": "0"}, {}).enabled
    assert resolve_config({"SEMBLEND_ENABLED": "0"}, {"--semblend-enabled": "1"}).enabled


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("{not json", "a JSON object"),
        ("[1, 2]", "a JSON object"),
        ("@/nonexistent/semblend.json", "a readable JSON file"),
        ('{"sink_tokens": -1}', "sink_tokens"),
    ],
)
def test_bad_config_json_names_the_problem(value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config({}, {}, value)
    assert fragment in str(info.value)


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from([m for m in MODES if m != "substitute"]),
    enabled=st.booleans(),
    min_similarity=st.floats(0.0, 1.0, allow_nan=False),
    sink=st.integers(0, 64),
    max_donors=st.integers(1, 10**6),
    chunk_log2=st.integers(3, 12),
)
def test_child_environment_reproduces_the_config(
    mode: str, enabled: bool, min_similarity: float, sink: int, max_donors: int, chunk_log2: int
) -> None:
    config = Config(
        mode=mode,
        enabled=enabled,
        min_similarity=min_similarity,
        sink_tokens=sink,
        max_donors=max_donors,
        chunk_avg_tokens=2**chunk_log2,
    )
    env = config_environ(config)
    assert all(key.startswith("SEMBLEND_") for key in env)
    assert Config.from_env(env) == config  # what the scheduler rebuilds is what we resolved


def test_unknown_semblend_flags_are_found() -> None:
    args = ["--chunked-prefill-size", "512", "--semblend-sink-tokens=3", "--semblend-sinks", "4"]
    assert unknown_semblend_flags(args) == ["--semblend-sinks"]


def _invoke(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, env={"SEMBLEND_ENABLED": None})
    return result.exit_code, result.output


def test_bad_flag_value_is_a_usage_error_naming_the_flag() -> None:
    code, out = _invoke(["serve", "--model-path", "/nowhere", "--semblend-min-similarity", "1.5"])
    assert code == 2, out
    assert "--semblend-min-similarity" in out and "1.5" in out and "[0, 1]" in out
    code, out = _invoke(["serve", "--model-path", "/nowhere", "--semblend-mode", "fuzzy"])
    assert code == 2 and "--semblend-mode" in out and "exact_spans" in out, out


def test_unknown_semblend_flag_is_rejected_with_a_suggestion() -> None:
    code, out = _invoke(["serve", "--model-path", "/nowhere", "--semblend-sink-token", "3"])
    assert code == 2, out
    assert "--semblend-sink-token" in out and "did you mean --semblend-sink-tokens" in out


def test_bare_form_runs_serve() -> None:
    # The same validation error as `serve` proves the bare form reached the serve command
    # (and that nothing was started: validation runs first).
    code, out = _invoke(["--model-path", "/nowhere", "--semblend-max-spans", "0"])
    assert code == 2 and "--semblend-max-spans" in out, out
    code, out = _invoke(["--version"])
    assert code == 0 and "semblend-sglang" in out


def test_serve_help_lists_semblend_and_sglang_flags() -> None:
    code, out = _invoke(["serve", "--help"])
    assert code == 0, out
    for flag in ("--semblend-mode", "--semblend-min-similarity", "--semblend-config"):
        assert flag in out
    for flag in ("--chunked-prefill-size", "--enable-hierarchical-cache", "--enable-metrics"):
        assert flag in out  # from sglang's own argument parser


def test_merge_snapshots_sums_ranks() -> None:
    a = {
        "outcomes": {"exact": 2, "materialized": 1},
        "declined": {"donor_evicted": 1},
        "reused_tokens": 900,
        "requests": 3,
        "lookups": 2,
        "lookup_ms_mean": 1.0,
        "donors": 4,
        "errors": {},
    }
    a["hook_seconds"] = 0.25
    b = dict(a, outcomes={"materialized": 2}, lookups=6, lookup_ms_mean=3.0, reused_tokens=100)
    b["hook_seconds"] = 0.5
    total = merge_snapshots([a, None, b])
    assert total["hook_seconds"] == pytest.approx(0.75)
    assert total["outcomes"] == {"exact": 2, "materialized": 3}
    assert total["declined"] == {"donor_evicted": 2}
    assert total["reused_tokens"] == 1000 and total["lookups"] == 8
    assert total["lookup_ms_mean"] == pytest.approx((2 * 1.0 + 6 * 3.0) / 8)
    assert merge_snapshots([None]) == {}
