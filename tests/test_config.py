"""Config: sources, precedence, discovery_only/mode interplay, and one error per bad value."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from semblend_sglang.config import (
    FIELDS,
    Config,
    ConfigError,
    FieldSpec,
    cli_options,
    parse_value,
    settings_table,
)
from semblend_sglang.config_fields import format_default, is_choice_enum, parse_flag
from semblend_sglang.recompute_strategy import RecomputeStrategy

# The kv_connector_extra_config of the semblend-vllm-connector package's description, less its
# `provider` key (the vLLM connector's settings accept and drop it; tests/test_vllm_settings.py).
SEMBLEND_VLLM_CONNECTOR_EXTRA_CONFIG = {
    "mode": "discovery_only",
    "min_prompt_tokens": 256,
    "min_similarity": 0.70,
    "min_reuse_ratio": 0.50,
    "embedder_type": "minilm",
    "model_id": "meta-llama/Llama-3.1-8B-Instruct",
}


def test_defaults_match_the_documented_table() -> None:
    config = Config.from_env({})
    assert config == Config()
    assert config.enabled is True
    assert config.mode == "exact_spans"
    assert config.min_similarity == 0.60
    assert config.embedder == "minilm"
    assert config.discovery_only is False
    assert config.strict_prefix_boundary is False
    assert config.max_plan_donors == 8
    assert config.exact_materialization_only is True
    for spec in FIELDS:
        if spec.name != "discovery_only":
            assert getattr(config, spec.name) == spec.default, spec.name


def test_env_values_are_parsed() -> None:
    config = Config.from_env(
        {
            "SEMBLEND_ENABLED": "0",
            "SEMBLEND_MIN_SIMILARITY": "0.75",
            "SEMBLEND_EMBEDDER": "Jaccard",
            "SEMBLEND_STRICT_PREFIX_BOUNDARY": "false",
            "SEMBLEND_EXACT_MATERIALIZATION_ONLY": "off",
            "SEMBLEND_MODE": "substitute",
            "SEMBLEND_MAX_SPANS": "3",
            "SEMBLEND_SINK_TOKENS": "0",
            "PATH": "/usr/bin",
        }
    )
    assert config.enabled is False
    assert config.min_similarity == 0.75
    assert config.embedder == "jaccard"
    assert config.strict_prefix_boundary is False
    assert config.mode == "substitute"
    assert config.max_spans == 3
    assert config.sink_tokens == 0
    assert config.unknown_keys == ()


def test_semblend_vllm_connector_json_shape_is_accepted() -> None:
    config = Config.from_json(SEMBLEND_VLLM_CONNECTOR_EXTRA_CONFIG)
    assert config.mode == "discovery_only"
    assert config.discovery_only
    assert config.unknown_keys == ()
    assert config.min_prompt_tokens == 256
    assert config.min_similarity == 0.70
    assert config.min_reuse_ratio == 0.50
    assert config.embedder == "minilm"
    assert config.model_id == "meta-llama/Llama-3.1-8B-Instruct"


def test_precedence_defaults_env_json_cli() -> None:
    env = {"SEMBLEND_MIN_SIMILARITY": "0.5", "SEMBLEND_MAX_SPANS": "2", "SEMBLEND_SINK_TOKENS": "9"}
    json_obj = {"min_similarity": 0.6, "max_spans": 5}
    cli = {"--semblend-min-similarity": "0.7", "semblend_max_spans": None}
    config = Config.from_sources(env=env, json_obj=json_obj, cli=cli)
    assert config.min_similarity == 0.7  # cli beats json and env
    assert config.max_spans == 5  # json beats env; a None cli value means "not given"
    assert config.sink_tokens == 9  # env beats the default
    assert config.min_prompt_tokens == 256  # default


def test_unknown_env_vars_and_json_keys_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    env = {"SEMBLEND_MIN_SIMILARTY": "0.9", "SEMBLEND_MODEL_CACHE": "/cache", "OTHER": "1"}
    with caplog.at_level(logging.WARNING, logger="semblend_sglang.config"):
        config = Config.from_sources(env=env, json_obj={"min_similarty": 0.9})
        Config.from_sources(env=env)
    assert config.unknown_keys == ("SEMBLEND_MIN_SIMILARTY", "min_similarty")
    assert config.min_similarity == 0.60
    messages = [r.getMessage() for r in caplog.records]
    assert sum("SEMBLEND_MIN_SIMILARTY" in m for m in messages) <= 1  # logged once per process
    assert not any("SEMBLEND_MODEL_CACHE" in m for m in messages)


def _bad_values(spec: FieldSpec) -> list[object]:
    if spec.type is bool:
        return ["maybe", "2"]
    if spec.type is int:
        below = int(spec.minimum) - 1 if spec.minimum is not None else None
        out: list[object] = ["ten", "1.5"]
        if below is not None:
            out.append(str(below))
        if spec.maximum is not None:
            out.append(str(int(spec.maximum) + 1))
        return out
    if spec.type is float:
        out = ["high", "nan"]
        if spec.minimum is not None:
            out.append(str(spec.minimum - 0.5))
        if spec.maximum is not None:
            out.append(str(spec.maximum + 0.5))
        return out
    return ["not-a-choice"] if spec.choices else []


BAD_CASES = [(spec, bad) for spec in FIELDS for bad in _bad_values(spec)]


@pytest.mark.parametrize(("spec", "bad"), BAD_CASES, ids=[f"{s.name}={b}" for s, b in BAD_CASES])
def test_each_bad_value_names_key_value_and_allowed(spec: FieldSpec, bad: object) -> None:
    for source, key, kwargs in (
        ("env", spec.env, {"env": {spec.env: bad}}),
        ("json", spec.name, {"json_obj": {spec.name: bad}}),
        ("cli", spec.flag, {"cli": {spec.flag: bad}}),
    ):
        with pytest.raises(ConfigError) as err:
            Config.from_sources(**kwargs)
        assert err.value.key == key, source
        assert err.value.value == bad
        assert key in str(err.value) and repr(bad) in str(err.value)
        assert err.value.allowed == spec.allowed()


def test_json_type_errors() -> None:
    with pytest.raises(ConfigError, match="min_prompt_tokens"):
        Config.from_json({"min_prompt_tokens": True})
    with pytest.raises(ConfigError, match="kv_connector_extra_config"):
        Config.from_json(["mode"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="embedder_type"):
        Config.from_json({"embedder": "minilm", "embedder_type": "jaccard"})
    with pytest.raises(ConfigError, match="chunk_avg_tokens"):
        Config.from_json({"chunk_avg_tokens": 100})
    with pytest.raises(ConfigError, match="dispatch_chunk_avg_tokens"):
        Config.from_json({"dispatch_chunk_avg_tokens": 48})
    with pytest.raises(ConfigError, match="--semblend-no-such-flag"):
        Config.from_sources(cli={"--semblend-no-such-flag": "1"})


def test_discovery_only_and_mode_interplay() -> None:
    assert Config.from_env({"SEMBLEND_DISCOVERY_ONLY": "1"}).mode == "discovery_only"
    assert Config.from_env({"SEMBLEND_DISCOVERY_ONLY": "0"}).mode == "exact_spans"
    assert (
        Config.from_env({"SEMBLEND_DISCOVERY_ONLY": "1", "SEMBLEND_MODE": "discovery_only"}).mode
        == "discovery_only"
    )
    with pytest.raises(ConfigError) as err:
        Config.from_env({"SEMBLEND_DISCOVERY_ONLY": "1", "SEMBLEND_MODE": "exact_spans"})
    assert err.value.key == "SEMBLEND_DISCOVERY_ONLY"
    with pytest.raises(ConfigError):
        Config.from_env({"SEMBLEND_DISCOVERY_ONLY": "0", "SEMBLEND_MODE": "discovery_only"})
    with pytest.raises(ConfigError) as err:
        Config.from_sources(cli={"--semblend-discovery-only": "1", "--semblend-mode": "substitute"})
    assert err.value.key == "--semblend-discovery-only"
    # across sources the higher source's mode wins
    config = Config.from_sources(
        env={"SEMBLEND_DISCOVERY_ONLY": "1"}, cli={"--semblend-mode": "exact_spans"}
    )
    assert config.mode == "exact_spans"
    config = Config.from_sources(
        env={"SEMBLEND_MODE": "exact_spans"}, json_obj={"discovery_only": True}
    )
    assert config.mode == "discovery_only"


def test_substitute_mode_needs_exact_materialization_off() -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_env({"SEMBLEND_MODE": "substitute"})
    assert "SEMBLEND_EXACT_MATERIALIZATION_ONLY=0" in str(err.value)
    config = Config.from_env(
        {"SEMBLEND_MODE": "substitute", "SEMBLEND_EXACT_MATERIALIZATION_ONLY": "0"}
    )
    assert config.mode == "substitute"


def test_the_check_share_is_a_share() -> None:
    assert Config.from_env({"SEMBLEND_RECOMPUTE_CHECK_SHARE": "0.3"}).recompute_check_share == 0.3
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="SEMBLEND_RECOMPUTE_CHECK_SHARE"):
            Config.from_env({"SEMBLEND_RECOMPUTE_CHECK_SHARE": bad})


def test_cli_mapping_covers_every_field() -> None:
    options = cli_options()
    assert [o["name"] for o in options] == [f.name for f in FIELDS]
    for option in options:
        assert option["flag"] == "--semblend-" + option["name"].replace("_", "-")
        assert option["env"] == "SEMBLEND_" + option["name"].upper()
        assert option["help"]
    names = {o["env"] for o in options}
    for required in (
        "SEMBLEND_ENABLED",
        "SEMBLEND_MIN_SIMILARITY",
        "SEMBLEND_EMBEDDER",
        "SEMBLEND_DISCOVERY_ONLY",
        "SEMBLEND_STRICT_PREFIX_BOUNDARY",
        "SEMBLEND_EXACT_MATERIALIZATION_ONLY",
        "SEMBLEND_MODE",
    ):
        assert required in names


def test_config_is_frozen_and_validated_on_construction() -> None:
    config = Config()
    with pytest.raises(AttributeError):
        config.mode = "substitute"  # type: ignore[misc]
    with pytest.raises(ConfigError):
        Config(max_spans=0)
    assert Config(max_spans=2).as_dict()["max_spans"] == 2


def test_fields_are_derived_from_the_config_dataclass() -> None:
    """Each setting is declared once, as a Config field: FIELDS is those fields in order (with
    the discovery_only shorthand after mode), each spec's default the field's default."""
    declared = [f for f in dataclasses.fields(Config) if f.name != "unknown_keys"]
    names = [f.name for f in declared]
    assert [s.name for s in FIELDS] == [*names[:2], "discovery_only", *names[2:]]
    by_name = {s.name: s for s in FIELDS}
    for f in declared:
        assert by_name[f.name].default == f.default, f.name
        kind = by_name[f.name].type
        assert kind in (bool, int, float, str) or is_choice_enum(kind), f.name
        assert by_name[f.name].help, f.name


def test_a_choice_setting_holds_its_enum() -> None:
    """recompute_strategy is a RecomputeStrategy from every source, its string included."""
    assert Config().recompute_strategy is RecomputeStrategy.DEVIATION
    assert Config(recompute_strategy="heads").recompute_strategy is RecomputeStrategy.HEADS  # type: ignore[arg-type]
    env = Config.from_env({"SEMBLEND_RECOMPUTE_STRATEGY": " Query "})
    assert env.recompute_strategy is RecomputeStrategy.QUERY
    assert Config().as_dict()["recompute_strategy"] == "deviation"
    assert type(Config().as_dict()["recompute_strategy"]) is str
    with pytest.raises(ConfigError, match="one of heads, deviation, query"):
        Config(recompute_strategy="nearest")  # type: ignore[arg-type]


def test_the_documented_table_is_the_generated_one() -> None:
    """docs/provider.md holds `semblend-sglang settings`' table, unedited."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "provider.md").read_text()
    begin = doc.index("<!-- settings table:")
    start = doc.index("\n", begin) + 1
    end = doc.index("<!-- end of settings table -->", start)
    assert doc[start:end] == settings_table(), (
        "docs/provider.md's settings table is stale: replace it by `semblend-sglang settings`"
    )


def test_every_default_reads_back_from_the_table() -> None:
    for spec in FIELDS:
        shown = format_default(spec)
        if shown.endswith(" MiB"):
            shown = str(int(shown.removesuffix(" MiB")) * 1024 * 1024)
        value = parse_value(spec, "" if shown == '""' else shown, spec.name)
        assert value == spec.default, spec.name


def test_the_table_lists_the_tuning_settings_apart() -> None:
    from semblend_sglang.presets import REPAIR_SETTINGS, TUNING_SETTINGS

    names = {spec.name for spec in FIELDS}
    assert TUNING_SETTINGS <= names
    table = settings_table()
    user, tuning = table.split("**Tuning")
    assert "| recompute_ratio |" in user and "| preset |" in user and "| enabled |" in user
    assert "| recompute_check_layer |" in tuning and "| recompute_ratio |" not in tuning
    for name in names:
        assert (f"| {name} |" in tuning) == (name in TUNING_SETTINGS), name
    # a request's repair settings: the strategy and budget a user sets, the rest tuning
    assert {"recompute_strategy", "recompute_ratio"} == set(REPAIR_SETTINGS) - TUNING_SETTINGS


def test_settings_command_prints_the_table() -> None:
    from click.testing import CliRunner

    from semblend_sglang.cli import main

    result = CliRunner().invoke(main, ["settings"])
    assert result.exit_code == 0, result.output
    assert result.output == settings_table()


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("1", True),
        (" TRUE ", True),
        ("yes", True),
        ("On", True),
        ("0", False),
        ("false", False),
        (" No", False),
        ("OFF", False),
        ("", None),
        ("2", None),
        ("enabled", None),
        (None, None),
    ],
)
def test_parse_flag_is_the_one_reading_of_a_boolean(raw: str | None, want: bool | None) -> None:
    assert parse_flag(raw) is want
