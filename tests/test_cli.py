"""The ``semblend-sglang`` CLI: prepare-model (cached, offline) and serve (Ctrl-C stops all)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from semblend_sglang.cli import main
from semblend_sglang.model_prep import MARKER, MODEL_FOLDER_NAME, default_cache_dir
from semblend_sglang.server import CPU_SERVER_FLAGS, build_server_command, free_port, http_json

CLI = [sys.executable, "-m", "semblend_sglang.cli"]


def test_prepared_folder_is_a_complete_bf16_hf_model(smollm2_model_dir: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        MARKER,
    ):
        assert (smollm2_model_dir / name).is_file(), name
    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    with safe_open(str(smollm2_model_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "lm_head.weight" not in keys  # tied to the embedding
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.bfloat16"
    # 30 layers x 9 tensors + embedding + final norm, nothing dropped but the tied head.
    assert len(keys) == 30 * 9 + 2


def test_prepare_model_reuses_the_cached_folder(smollm2_model_dir: Path) -> None:
    safetensors = smollm2_model_dir / "model.safetensors"
    before = safetensors.stat().st_mtime_ns
    runner = CliRunner()
    by_flag = runner.invoke(main, ["prepare-model", "--cache-dir", str(smollm2_model_dir.parent)])
    assert by_flag.exit_code == 0, by_flag.output
    assert by_flag.output.strip() == str(smollm2_model_dir)
    by_env = runner.invoke(
        main, ["prepare-model"], env={"SEMBLEND_MODEL_CACHE": str(smollm2_model_dir.parent)}
    )
    assert by_env.exit_code == 0, by_env.output
    assert by_env.output.strip() == str(smollm2_model_dir)
    assert safetensors.stat().st_mtime_ns == before


def test_default_cache_dir_env_and_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEMBLEND_MODEL_CACHE", raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "semblend-sglang" / "models"
    monkeypatch.setenv("SEMBLEND_MODEL_CACHE", "/x/y")
    assert default_cache_dir() == Path("/x/y")
    assert MODEL_FOLDER_NAME.endswith("-bf16")


def test_server_command_cpu_flags_can_be_overridden() -> None:
    cmd = build_server_command("/m", port=1234, extra_args=["--max-total-tokens", "8192"], cpu=True)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert cmd.count("--max-total-tokens") == 1
    assert cmd[cmd.index("--max-total-tokens") + 1] == "8192"
    for flag in ("--device", "--attention-backend", "--disable-cuda-graph", "--sleep-on-idle"):
        assert flag in cmd
    gpu = build_server_command("/m", cpu=False)
    assert not set(CPU_SERVER_FLAGS) & set(gpu[7:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _check_substitute_mode_in_the_scheduler(url: str, tokenizer: Any, essay: str) -> None:
    """The launcher's --semblend-* flags configured the scheduler (substitute mode, MiniLM gate);
    the snapshot route answers; a request with another instruction in front of the same document
    is rewritten to the donor's prompt and served from SGLang's exact cache."""
    snap = http_json(url + "/semblend/snapshot")
    assert snap["config"]["mode"] == "substitute", snap
    assert snap["config"]["max_donors"] == 5000 and snap["config"]["min_prompt_tokens"] == 64
    doc = tokenizer.encode(essay, add_special_tokens=False)[:300]
    answers = []
    prompts = []
    for head in ("Summarize this essay.\n\n", "List the claims of this essay.\n\n"):
        prompts.append(tokenizer.encode(head, add_special_tokens=False) + doc)
        payload = {
            "input_ids": prompts[-1],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
        answers.append(http_json(url + "/generate", payload))
    donor, substituted = answers
    # Output-changing by design: the model saw the donor's prompt, so it answers like the donor.
    assert substituted["meta_info"]["prompt_tokens"] == len(prompts[0])
    assert substituted["meta_info"]["cached_tokens"] >= len(prompts[0]) - 1
    assert substituted["text"] == donor["text"]
    snap = http_json(url + "/semblend/snapshot")
    assert len(snap["ranks"]) == 1
    assert snap["total"]["outcomes"].get("materialized", 0) == 1, snap
    assert snap["total"]["reused_tokens"] >= len(doc), snap
    assert snap["total"]["errors"] == {}, snap
    info = http_json(url + "/server_info")
    assert info["internal_states"][0]["semblend"]["outcomes"] == snap["total"]["outcomes"]
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    assert 'semblend_requests_total{outcome="materialized"' in metrics


@pytest.mark.e2e
def test_bare_launcher_with_semblend_flags_serves_and_sigint_stops_everything(
    smollm2_model_dir: Path, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    port = free_port()
    # The bare form (no "serve"), sglang flags and --semblend-* flags mixed.
    command = [*CLI, "--model-path", str(smollm2_model_dir), "--port", str(port)]
    command += ["--enable-metrics", "--semblend-mode", "substitute"]
    command += ["--semblend-exact-materialization-only", "0", "--semblend-min-similarity", "0.8"]
    command += ["--semblend-max-donors", "5000", "--semblend-min-prompt-tokens", "64"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        ready = ""
        deadline = time.monotonic() + 600
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            if "ready at" in line:
                ready = line
                break
        assert f"http://127.0.0.1:{port}" in ready, ready
        _check_substitute_mode_in_the_scheduler(
            f"http://127.0.0.1:{port}", smollm2_tokenizer, essay_texts[4]
        )
        children = subprocess.run(
            ["pgrep", "-f", f"sglang.launch_server.*--port {port}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert children, "no sglang.launch_server process found"
        server_pgid = os.getpgid(int(children[0]))
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while _group_alive(server_pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _group_alive(server_pgid), "server processes survived Ctrl-C"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
