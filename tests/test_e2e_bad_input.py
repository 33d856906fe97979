"""Bad input against the real SGLang 0.5.23 server on CPU, semblend on and off: a fixed list of
malformed and edge requests, concurrent mixes of good and bad ones, a client that disconnects
mid-request, a prompt at the context limit. Every bad request gets a 4xx with a reason in
SGLang's error body; every good one is answered as it is alone; the server stays up; with
semblend on, the snapshot accounts for every request that reached the scheduler and the next
semantic hit reuses and answers as a cold run does.

Without the request guard (patches/sglang/engine/request_guard.py) three of these requests kill
SGLang 0.5.23 (docs/sglang.md, "Bad input"). SGLang checks its pools when idle and raises on a
leak (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, on by default): a server still healthy after
idling, its log free of leak reports, is one whose pools balanced.
"""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest

from semblend_sglang.bench.client import health_generate
from semblend_sglang.server import SglangServer
from tests.conftest import VANILLA_CONTEXT
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e

CONTEXT = VANILLA_CONTEXT
"""The servers' ``--context-length``: small, so a prompt at the limit is cheap to compute."""

MAX_PROMPT = CONTEXT - 1 - 5 - 1
"""The longest prompt SGLang's scheduler computes: one token under its ``max_req_input_len``
(tp_worker.py: the context less 1, less 5 reserved; managers/utils.py refuses a prompt of that
length or more)."""

VOCAB = 49152
"""SmolLM2's vocabulary."""

GARBAGE = "\u202e\u200b\u0301 \U0001f600\u4e2d\u6587 \x07\x1b[0m \ufffd" * 8
"""Valid but hostile unicode: right-to-left override, zero-width space, a lone combining
mark, emoji, CJK, control and escape characters, the replacement character."""


@dataclass(frozen=True)
class Call:
    """One HTTP request of the fuzz list and what the server must answer."""

    name: str
    path: str
    body: Any
    status: int
    reason: str = ""
    """A part of the error message (a bad request) that tells the client what is wrong."""

    def send(self, url: str, timeout: float = 300.0) -> tuple[int, dict[str, Any]]:
        """POST the body (JSON, or raw bytes as they are); the status and the decoded answer."""
        parts = urlsplit(url)
        data = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        try:
            conn.request("POST", self.path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()


def _gen(name: str, body: dict[str, Any], status: int = 400, reason: str = "") -> Call:
    body.setdefault("sampling_params", {"max_new_tokens": 4, "temperature": 0})
    return Call(name, "/generate", body, status, reason)


def _openai(name: str, path: str, body: dict[str, Any], reason: str) -> Call:
    return Call(name, path, {"model": "default", "max_tokens": 4, **body}, 400, reason)


BAD: tuple[Call, ...] = (
    _gen("empty text", {"text": ""}, reason="no tokens"),
    _gen("empty ids", {"input_ids": []}, reason="cannot be empty"),
    _gen("ids past the vocabulary", {"input_ids": [1, 2, 10**6]}, reason="vocabulary"),
    _gen("id just past the vocabulary", {"input_ids": [5, VOCAB]}, reason="vocabulary"),
    _gen("negative ids", {"input_ids": [1, -5, 3]}, reason="vocabulary"),
    _gen("batch with one empty text", {"text": ["Hello there", ""]}, reason="no tokens"),
    _gen("prompt past the context", {"input_ids": [42] * (CONTEXT + 10)}, reason="context length"),
    _gen(
        "negative max_new_tokens",
        {"text": "Hello", "sampling_params": {"max_new_tokens": -1}},
        reason="max_new_tokens",
    ),
    _gen(
        "semblend_reuse not a known value",
        {
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 2, "custom_params": {"semblend_reuse": 5}},
        },
        reason="semblend_reuse",
    ),
    _gen(
        "semblend_reuse settings with an unknown key",
        {
            "text": "Hello",
            "sampling_params": {
                "max_new_tokens": 2,
                "custom_params": {"semblend_reuse": {"preset": "fast", "no_such": 1}},
            },
        },
        reason="semblend_reuse.no_such",
    ),
    _gen(
        "semblend_reuse settings with a ratio out of bounds",
        {
            "text": "Hello",
            "sampling_params": {
                "max_new_tokens": 2,
                "custom_params": {"semblend_reuse": {"recompute_ratio": 1.5}},
            },
        },
        reason="semblend_reuse.recompute_ratio",
    ),
    _gen(
        "more top logprobs than the vocabulary",
        {"text": "Hello", "return_logprob": True, "top_logprobs_num": 10**7},
        reason="top_logprobs_num",
    ),
    _gen("text of the wrong type", {"text": 5}, reason="valid string"),
    _gen("ids of the wrong type", {"input_ids": ["a", "b"]}, reason="must be int"),
    Call("malformed JSON", "/generate", b'{"text": ', 400, "JSON"),
    Call("invalid UTF-8", "/generate", b'{"text": "\xff\xfe\xfd"}', 400, "JSON"),
    _openai("completion: empty prompt", "/v1/completions", {"prompt": ""}, "empty"),
    _openai("completion: empty id list", "/v1/completions", {"prompt": []}, "empty"),
    _openai(
        "completion: ids past the vocabulary",
        "/v1/completions",
        {"prompt": [1, 10**8]},
        "vocabulary",
    ),
    _openai(
        "completion: prompt of the wrong type", "/v1/completions", {"prompt": {"a": 1}}, "valid"
    ),
    _openai("chat: no messages", "/v1/chat/completions", {"messages": []}, "empty"),
    _openai(
        "chat: messages of the wrong type", "/v1/chat/completions", {"messages": "hi"}, "valid list"
    ),
    _openai(
        "chat: a message without a role",
        "/v1/chat/completions",
        {"messages": [{"content": "hi"}]},
        "role",
    ),
    _openai(
        "chat: max_tokens of the wrong type",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"},
        "integer",
    ),
)
"""Malformed requests: each must get 400 with ``reason`` in its message."""


def _reason_of(answer: dict[str, Any]) -> str:
    """The message of SGLang's error body: ``{"error": {"message": ...}}`` (/generate) or
    ``{"object": "error", "message": ...}`` (the OpenAI-compatible API)."""
    error = answer.get("error")
    return str(error.get("message") if isinstance(error, dict) else answer.get("message", ""))


def _prompt(tokenizer: Any, essays: list[str], first: int, length: int) -> list[int]:
    """The first ``length`` tokens of the essays from index ``first`` on, joined."""
    ids: list[int] = []
    for text in essays[first:]:
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
        if len(ids) >= length:
            return ids[:length]
    raise AssertionError(f"the essays from {first} on have fewer than {length} tokens")


def _disconnect_mid_request(
    url: str, ids: list[int], after_s: float, cache_salt: str | None = None
) -> None:
    """Send a streamed ``/generate`` of ``ids`` and close the connection ``after_s`` seconds
    later, before its answer is read (SGLang then aborts the request)."""
    parts = urlsplit(url)
    body: dict[str, Any] = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 64},
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request(
        "POST", "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    time.sleep(after_s)
    conn.close()


MODES = ("on", "off")
"""semblend on (default settings) or off (``SEMBLEND_ENABLED=0``: the plugin installs the request
guard only)."""


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest) -> tuple[str, SglangServer]:
    """The :data:`MODES` server named by the parameter, with its mode, both the session's and at
    :data:`CONTEXT` (tests/conftest.py): "on" is ``semblend_at_the_context``, "off" the shared
    ``vanilla_server``."""
    name = "semblend_at_the_context" if request.param == "on" else "vanilla_server"
    srv: SglangServer = request.getfixturevalue(name)
    assert srv.alive(), f"{name} was stopped (test_e2e_gateway.py stops it last)"
    return request.param, srv


def test_every_bad_request_gets_a_reason_and_the_server_keeps_serving(
    server: tuple[str, SglangServer], smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    mode, srv = server
    url = srv.url
    before = semblend_totals(url) if mode == "on" else None
    good = [_prompt(smollm2_tokenizer, essay_texts, 20 + i, 60 + 20 * i) for i in range(3)]
    alone = [generate(url, ids, 8)["output_ids"] for ids in good]
    reached = len(good)  # requests that reached the scheduler (bad ones stop before it)

    for call in BAD:
        status, answer = call.send(url)
        assert (status, call.reason.lower() in _reason_of(answer).lower()) == (400, True), (
            call.name,
            status,
            answer,
        )
        assert srv.alive(), call.name

    # Edge requests that are valid: answered.
    one = generate(url, [42], 3)
    garbage = generate(url, GARBAGE, 3)
    chat = Call(
        "chat: empty content",
        "/v1/chat/completions",
        {"model": "default", "messages": [{"role": "user", "content": ""}], "max_tokens": 3},
        200,
    ).send(url)
    assert one["meta_info"]["completion_tokens"] == 3 and one["meta_info"]["prompt_tokens"] == 1
    assert garbage["meta_info"]["completion_tokens"] == 3
    assert chat[0] == 200 and chat[1]["usage"]["completion_tokens"] == 3, chat
    reached += 3

    # At the context limit: the longest prompt SGLang computes, and one token more (refused by
    # SGLang's scheduler: the abort comes back as 400 with its message).
    limit = _prompt(smollm2_tokenizer, essay_texts, 30, MAX_PROMPT + 1)
    at_limit = generate(url, limit[:MAX_PROMPT], 1)
    assert at_limit["meta_info"]["prompt_tokens"] == MAX_PROMPT
    over = Call(
        "one past the limit",
        "/generate",
        {"input_ids": limit, "sampling_params": {"max_new_tokens": 1}},
        400,
    ).send(url)
    assert over[0] == 400 and "exceeds the maximum allowed length" in _reason_of(over[1]), over
    reached += 2

    # Concurrent mixes: each good request among bad ones answers as it did alone (the bad ones
    # never reach the scheduler, so the good one is computed in a batch of its own).
    mix = [BAD[0], BAD[2], BAD[4], BAD[6], BAD[14]]
    with ThreadPoolExecutor(max_workers=len(mix) + 1) as pool:
        for ids, want in zip(good, alone, strict=True):
            bad_futures = [pool.submit(call.send, url) for call in mix]
            answer = pool.submit(generate, url, ids, 8)
            assert [f.result()[0] for f in bad_futures] == [400] * len(mix)
            assert answer.result()["output_ids"] == want
    reached += len(good)

    # A client that disconnects mid-request, twice.
    long_prompt = _prompt(smollm2_tokenizer, essay_texts, 33, 900)
    for after_s in (0.05, 0.5):
        _disconnect_mid_request(url, long_prompt, after_s)
    reached += 2

    time.sleep(2.0)  # idle: the scheduler runs its strict pool and tree checks
    assert health_generate(url), "the scheduler no longer runs a forward"
    assert [generate(url, ids, 8)["output_ids"] for ids in good] == alone
    reached += 3
    assert srv.alive()
    log = srv.log_tail(20000)
    assert "memory leak" not in log and "Traceback" not in log

    if before is not None:
        after = semblend_totals(url)
        got = after["requests"] - before["requests"]
        # health_generate's request is one more; a disconnected request whose tokens never
        # reached the scheduler is not counted (SGLang aborts it in the tokenizer manager)
        assert reached + 1 - 2 <= got <= reached + 1, (got, reached, after["outcomes"])
        assert after["errors"] == before["errors"] == {}, after
        assert after["outcomes"].get("cold_fallback", 0) == 0, after


@pytest.mark.parametrize("server", ["on"], indirect=True)  # semblend off has no semantic path
def test_semantic_path_under_a_disconnect_ends_cleanly_and_the_next_hit_reuses(
    server: tuple[str, SglangServer], smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    """A semantic hit whose client disconnects while it is admitted or computed (donor copy,
    check layer), then a malformed request; then, on the same scheduler, a hit in another
    namespace (so the aborted request cannot be its donor): it reuses (the server's counters)
    and answers exactly as the same hit does in a third namespace where nothing failed. Its
    answer beside a cold run of the same prompt (another cache_salt) is reuse's quality,
    which the bench measures (docs/perf.md); here both must be complete."""
    _, srv = server
    url = srv.url
    enc = smollm2_tokenizer.encode
    doc = _prompt(smollm2_tokenizer, essay_texts, 40, 800)
    head = [enc(t, add_special_tokens=False) for t in INSTRUCTIONS]
    donor, target = head[0] + doc, head[1] + doc

    start = semblend_totals(url)
    generate(url, donor, 2, cache_salt="faulted")
    _disconnect_mid_request(url, target, 0.1, cache_salt="faulted")
    bad = Call("past the vocabulary", "/generate", {"input_ids": [*target, VOCAB + 1]}, 400)
    assert bad.send(url)[0] == 400
    time.sleep(2.0)
    faulted = semblend_totals(url)
    assert faulted["requests"] - start["requests"] == 2, faulted  # the donor, the aborted hit
    ended = (
        _delta(faulted, start, "materialized")
        + faulted["declined"].get("aborted", 0)
        - start["declined"].get("aborted", 0)
    )
    assert ended == 1, faulted  # the aborted hit: materialized before the abort, or declined

    answers = []
    for salt in ("clean", None):  # the reference where nothing failed, then the next hit
        generate(url, donor, 2, cache_salt=salt)
        before = semblend_totals(url)
        answers.append(generate(url, target, 8, cache_salt=salt)["output_ids"])
        after = semblend_totals(url)
        assert _delta(after, before, "materialized") == 1, (salt, after)
    assert answers[1] == answers[0]
    cold = generate(url, target, 8, cache_salt="cold")
    assert cold["meta_info"]["cached_tokens"] == 0 and len(cold["output_ids"]) == len(answers[1])
    assert after["errors"] == {} and after["outcomes"].get("cold_fallback", 0) == 0, after
    time.sleep(2.0)
    assert health_generate(url) and srv.alive()
    assert "memory leak" not in srv.log_tail(20000)


def _delta(after: dict[str, Any], before: dict[str, Any], outcome: str) -> int:
    return int(after["outcomes"].get(outcome, 0)) - int(before["outcomes"].get(outcome, 0))


INSTRUCTIONS = (
    "Summarize the following essay in three sentences.\n\n",
    "Write a title for the essay that follows.\n\n",
    "Read the essay below carefully and list the author's main arguments.\n\n",
)
