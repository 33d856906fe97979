"""Malformed ``python -m semblend_sglang.bench`` flags: one usage error naming the option, exit
code 2, no traceback, before any server starts."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from semblend_sglang.bench.e2e import command


@pytest.mark.parametrize(
    ("args", "option", "fragment"),
    [
        (["--lengths", "abc"], "--lengths", "'abc' is not a context length"),
        (["--lengths", "512,"], "--lengths", "'' is not a context length"),
        (["--lengths", "-5"], "--lengths", "'-5' is not a context length"),
        (["--groups", "0"], "--groups", "0 is not in the range"),
        (["--workloads", "rag,nope"], "--workloads", "unknown workload(s) ['nope']"),
        (["--systems", "vanilla,fast"], "--systems", "fast"),
        (["--semblend-env", "FOO"], "--semblend-env", "expected KEY=VALUE"),
        (["--seed", "many"], "--seed", "'many' is not a valid integer"),
        (["--workload", "/nonexistent.jsonl"], "--workload", "does not exist"),
        (["--answers-only", "--repeats", "2"], "--answers-only", "measures each probe once"),
    ],
)
def test_a_malformed_flag_is_one_usage_error_naming_it(
    args: list[str], option: str, fragment: str
) -> None:
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2, result.output
    assert option in result.output and fragment in result.output, result.output
    assert "Traceback" not in result.output
    assert "starting" not in result.output  # rejected before any server starts
