"""``semblend-sglang doctor``: SGLang 0.5.23's own flag parser and resolution pipeline, on this
machine and with SGLang's platform facts overridden for a named GPU (``override_platform``), and
the verdict the server's own checks give."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from semblend_sglang.cli import main

pytest.importorskip("sglang")


def _doctor(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["doctor", *args], catch_exceptions=False)
    return result.exit_code, result.output


def _prefill_line(output: str) -> str:
    (line,) = [x for x in output.splitlines() if x.strip().startswith("prefill:")]
    return line


@pytest.mark.parametrize(
    ("gpu", "backend", "page", "reuse"),
    [("h100", "fa3", 1, True), ("a100", "flashinfer", 1, True), ("b200", "trtllm_mha", 64, True)],
)
def test_each_gpus_default_backend_is_named_with_its_reason(
    smollm2_model_dir: Path, gpu: str, backend: str, page: int, reuse: bool
) -> None:
    """SGLang's default per GPU (fa3 on Hopper, trtllm_mha with page size 64 on Blackwell,
    flashinfer elsewhere): reuse is on where the split view serves that backend, otherwise off
    with the reason naming the backend."""
    code, out = _doctor("--assume-gpu", gpu, "--model-path", str(smollm2_model_dir))
    assert code == 0, out
    line = _prefill_line(out)
    assert f"[backend {backend}, page size {page}]" in line, out
    if reuse:
        assert "reuse: on " in line, out
    else:
        assert f"reuse: off (attention backend {backend}:" in line, out
    assert f"resolved for {gpu}" in out


def test_triton_and_fa3_on_a_gpu_reuse_at_every_page_size(smollm2_model_dir: Path) -> None:
    model = ("--model-path", str(smollm2_model_dir))
    for gpu, backend in (("a100", "triton"), ("h100", "fa3")):
        for page in ("1", "16", "64"):
            code, out = _doctor(
                "--assume-gpu", gpu, "--attention-backend", backend, "--page-size", page, *model
            )
            assert code == 0, out
            line = _prefill_line(out)
            assert f"reuse: on  [backend {backend}, page size {page}]" in line, out


def test_this_machine_torch_native_reuses_at_any_page_size(smollm2_model_dir: Path) -> None:
    model = ("--model-path", str(smollm2_model_dir), "--device", "cpu")
    for page in ("1", "16"):
        code, out = _doctor("--attention-backend", "torch_native", "--page-size", page, *model)
        assert code == 0, out
        assert f"reuse: on  [backend torch_native, page size {page}]" in _prefill_line(out)
        assert "resolved for this machine" in out


def test_unsupported_options_are_named(smollm2_model_dir: Path) -> None:
    code, out = _doctor(
        "--attention-backend",
        "torch_native",
        "--device",
        "cpu",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--model-path",
        str(smollm2_model_dir),
    )
    assert code == 0, out
    assert "reuse: off (--kv-cache-dtype fp8_e4m3:" in _prefill_line(out), out


@pytest.mark.parametrize(
    "flags",
    [["--page-size", "sixteen"], ["--no-such-flag"], []],
    ids=["bad-value", "unknown-flag", "no-model"],
)
def test_flags_sglang_refuses_exit_2(smollm2_model_dir: Path, flags: list[str]) -> None:
    model = ["--model-path", str(smollm2_model_dir)] if flags else []
    code, out = _doctor(*flags, *model)
    assert code == 2, out
    assert "semblend-sglang doctor:" in out
