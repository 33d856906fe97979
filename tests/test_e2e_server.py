"""End to end: the real SGLang 0.5.23 server on this CPU with the prepared SmolLM2 model.

The server is the session's shared one (tests/conftest.py ``semblend_server``: semblend on,
start-up costs 20-60 s on 2 cores). Requests go over HTTP exactly as a
user's would; exact prefix hits are read from the server's own ``cached_tokens``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.server import SglangServer, http_json
from tests.harness.server import generate

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(semblend_server: SglangServer) -> SglangServer:
    """The session's shared server (tests/conftest.py): semblend on, which must not change
    what these tests see."""
    return semblend_server


@pytest.fixture
def standin_log(sgl_kernel_standin_log: Path) -> Path:
    return sgl_kernel_standin_log


def test_chat_capital_of_france(server: SglangServer) -> None:
    answer = http_json(
        server.url + "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 32,
        },
    )
    text = answer["choices"][0]["message"]["content"]
    assert "Paris" in text, text


def test_exact_prefix_hit_on_repeat(
    server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    # an essay no other test on the shared server sends: a semantic hit on the first request
    # would publish only its exact head, and the repeat would not be an exact hit
    ids = smollm2_tokenizer.encode(essay_texts[40], add_special_tokens=False)[:500]
    prompt = smollm2_tokenizer.decode(ids)
    first = generate(server.url, prompt, 8)
    second = generate(server.url, prompt, 8)
    n = first["meta_info"]["prompt_tokens"]
    assert 490 <= n <= 510
    assert first["meta_info"]["cached_tokens"] < 50
    assert second["meta_info"]["cached_tokens"] >= 490
    # Greedy decoding on the same prompt gives the same text, hit or not.
    assert second["text"] == first["text"]


def test_sgl_kernel_standin_loaded_but_never_called(
    server: SglangServer, standin_log: Path
) -> None:
    # Runs after the requests above (file order); make one more so this test stands alone.
    generate(server.url, "Hello", 4, temperature=None)
    lines = standin_log.read_text().splitlines()
    imports = {line.split()[0] for line in lines if line.endswith(" import")}
    assert imports, "the stand-in was never imported: the CPU runtime did not reach sglang"
    calls = [line for line in lines if " call " in line]
    assert calls == []
