"""Per-request reuse settings (semblend_sglang/request_settings.py) and the named presets
(semblend_sglang/presets.py): what a request's ``custom_params.semblend_reuse`` resolves to over
the server's Config, the server-level preset, and that two processes resolve alike (what every
TP/DP rank does with the same request)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from typing import Any

import pytest

from semblend_sglang.config import FIELDS_BY_NAME, Config, ConfigError
from semblend_sglang.presets import PRESETS, REPAIR_SETTINGS
from semblend_sglang.recompute import RecomputeStrategy
from semblend_sglang.request_settings import CUSTOM_LABEL, SERVER_LABEL, resolve


def _differing(a: Config, b: Config) -> set[str]:
    return {f.name for f in fields(Config) if getattr(a, f.name) != getattr(b, f.name)}


@pytest.mark.parametrize("value", [True, "on"])
def test_on_is_the_servers_settings(value: Any) -> None:
    server = Config(recompute_ratio=0.3)
    settings = resolve(value, server)
    assert settings is not None and settings.config is server and settings.label == SERVER_LABEL


@pytest.mark.parametrize("value", [False, "off"])
def test_off_opts_out(value: Any) -> None:
    assert resolve(value, Config()) is None


def test_a_request_setting_replaces_only_that_setting_of_the_servers() -> None:
    server = Config(recompute_ratio=0.3, max_spans=4, recompute_recheck_depth=0.25)
    settings = resolve({"recompute_strategy": "query", "quality_gate": 0.5}, server)
    assert settings is not None and settings.label == CUSTOM_LABEL
    assert settings.config.recompute_strategy is RecomputeStrategy.QUERY
    assert _differing(server, settings.config) == {"recompute_strategy", "quality_gate"}


def test_a_request_preset_is_the_presets_values_over_the_defaults_not_the_servers() -> None:
    server = Config(recompute_ratio=0.3, recompute_recheck_width=2.0, max_spans=4)
    settings = resolve({"preset": "fast"}, server)
    assert settings is not None and settings.label == "fast"
    config = settings.config
    assert config.recompute_recheck_depth == 0.0 and config.preset == "fast"
    for name in REPAIR_SETTINGS:
        expected = PRESETS["fast"].get(name, FIELDS_BY_NAME[name].default)
        assert getattr(config, name) == expected, name
    assert config.max_spans == 4  # a server setting stays the server's


def test_a_request_setting_wins_over_its_preset() -> None:
    settings = resolve({"preset": "fast", "recompute_recheck_depth": 0.75}, Config())
    assert settings is not None and settings.label == CUSTOM_LABEL
    assert settings.config.recompute_recheck_depth == 0.75


def test_the_quality_preset_is_the_default() -> None:
    settings = resolve({"preset": "quality"}, Config())
    assert settings is not None and _differing(Config(), settings.config) == set()


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ({"recompute_ratio": 1.5}, "custom_params.semblend_reuse.recompute_ratio"),
        ({"recompute_ratio": "a lot"}, "custom_params.semblend_reuse.recompute_ratio"),
        (
            {"recompute_check_max_spans": -1},
            "custom_params.semblend_reuse.recompute_check_max_spans",
        ),
        ({"preset": None}, "custom_params.semblend_reuse.preset"),
        ({"sink_tokens": 0}, "custom_params.semblend_reuse.sink_tokens"),
        ({"no_such": 1}, "custom_params.semblend_reuse.no_such"),
        (None, "custom_params.semblend_reuse"),
        ([1], "custom_params.semblend_reuse"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_key(value: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(value, Config())
    assert err.value.key == key


def test_resolving_again_gives_the_same_settings_for_the_same_server_only() -> None:
    a, b = Config(recompute_ratio=0.2), Config(recompute_ratio=0.4)
    first = resolve({"quality_gate": 0.1}, a)
    assert first is not None and resolve({"quality_gate": 0.1}, a) == first
    other = resolve({"quality_gate": 0.1}, b)
    assert other is not None and other.config.recompute_ratio == 0.4


def test_a_server_preset_fills_the_repair_settings_no_source_sets() -> None:
    fast = Config.from_env({"SEMBLEND_PRESET": "fast"})
    assert fast.preset == "fast" and fast.recompute_recheck_depth == 0.0
    explicit = Config.from_sources(
        env={"SEMBLEND_RECOMPUTE_RECHECK_DEPTH": "0.25"}, cli={"--semblend-preset": "fast"}
    )
    assert explicit.preset == "fast" and explicit.recompute_recheck_depth == 0.25
    assert Config.from_env({}).recompute_recheck_depth == 0.5
    with pytest.raises(ConfigError) as err:
        Config.from_env({"SEMBLEND_PRESET": "fastest"})
    assert err.value.key == "SEMBLEND_PRESET"


def test_every_preset_names_only_repair_settings_and_is_valid() -> None:
    for name, values in PRESETS.items():
        assert set(values) <= set(REPAIR_SETTINGS), name
        settings = resolve({"preset": name}, Config())
        assert settings is not None


_RESOLVE_IN_A_PROCESS = """
import json, sys
from semblend_sglang.config import Config
from semblend_sglang.request_settings import resolve
server = Config.from_env(json.loads(sys.argv[1]))
out = []
for value in json.loads(sys.argv[2]):
    s = resolve(value, server)
    out.append(None if s is None else [s.label, s.config.as_dict()])
print(json.dumps(out))
"""


def test_two_processes_resolve_the_same_requests_alike() -> None:
    """What each TP/DP rank's scheduler does with the same request: the settings are a pure
    function of the request's value and the server's settings, in any process, whatever was
    resolved before (the values are given in another order to the second)."""
    env = {"SEMBLEND_PRESET": "fast", "SEMBLEND_RECOMPUTE_RATIO": "0.2"}
    values: list[Any] = [
        True,
        "off",
        {"preset": "quality"},
        {"recompute_strategy": "heads", "recompute_ratio": 0.5},
        {"recompute_ratio": 0.5, "recompute_strategy": "heads"},
        {"preset": "fast", "quality_gate": 0.01},
    ]
    runs = []
    for order in (values, values[::-1]):
        proc = subprocess.run(
            [sys.executable, "-c", _RESOLVE_IN_A_PROCESS, json.dumps(env), json.dumps(order)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1][::-1]
    assert runs[0][3] == runs[0][4]  # key order does not matter
    assert runs[0][0][1]["recompute_recheck_depth"] == 0.0  # the server's preset
    assert runs[0][2][1]["recompute_recheck_depth"] == 0.5  # the request's preset
