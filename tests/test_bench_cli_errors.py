"""Malformed ``python -m semblend_sglang.bench`` flags: one usage error naming the option, exit
code 2, no traceback, before any server starts."""

from __future__ import annotations

from pathlib import Path

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
        (
            ["--systems", "vanilla", "--url", "exact_spans=http://h:1"],
            "--url",
            "names exact_spans, not among --systems vanilla",
        ),
        (
            ["--url", "exact_spans=http://h:1", "--semblend-env", "SEMBLEND_MAX_SPANS=4"],
            "--semblend-env",
            "applies to started servers only, and --url names exact_spans",
        ),
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


def test_kernels_bench_rejects_an_unknown_dtype_and_times_a_float32_cache(tmp_path: Path) -> None:
    """``bench kernels --dtypes``: an unknown name is one usage error; float32 (a CPU server's
    cache) is timed like the others, on a tiny pool."""
    import json

    from semblend_sglang.bench.kernel_bandwidth import command as kernels

    bad = CliRunner().invoke(kernels, ["--dtypes", "float32,fp4"])
    assert bad.exit_code == 2 and "--dtypes" in bad.output and "Traceback" not in bad.output
    out = tmp_path / "k.json"
    shape = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--tokens", "16"]
    ok = CliRunner().invoke(
        kernels,
        [*shape, "--iters", "1", "--device", "cpu", "--dtypes", "float32", "--json", str(out)],
    )
    assert ok.exit_code == 0, ok.output
    (timed,) = json.loads(out.read_text())["dtypes"].items()
    assert timed[0] == "float32" and timed[1]["bytes_moved"] == 2 * 2 * 2 * 16 * 2 * 64 * 4
