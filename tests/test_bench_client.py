"""The bench's one HTTP client (semblend_sglang/bench/client.py) against a small real HTTP server
in this process that answers like SGLang: server-sent events from ``/generate``, a refused then
applied ``/flush_cache``, ``/semblend/snapshot`` and ``/health_generate``. The client against the
real SGLang server is exercised by tests/test_bench_e2e.py's quick run."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx
import pytest

from semblend_sglang.bench.client import (
    NoTokenStreamed,
    ServerClient,
    flush_cache,
    health_generate,
    semblend_snapshot,
    sse_events,
    stream_generate,
    try_flush,
)

FIRST_TOKEN_DELAY_S = 0.2
TAIL_DELAY_S = 3.0


def _chunk(text: str, completion: int, ids: list[int]) -> bytes:
    meta = {
        "prompt_tokens": 5,
        "cached_tokens": 2,
        "completion_tokens": completion,
        "output_token_logprobs": [[-0.5, i, None] for i in ids],
    }
    return b"data: " + json.dumps({"text": text, "meta_info": meta}).encode() + b"\n\n"


class _SGLangLike(BaseHTTPRequestHandler):
    """Answers the routes the client uses; ``requests`` keeps every request body."""

    requests: ClassVar[list[tuple[str, dict[str, Any]]]] = []
    flush_refusals: ClassVar[int] = 0
    semblend: ClassVar[bool] = True

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/semblend/snapshot" and type(self).semblend:
            self._send(200, {"total": {"hook_seconds": 0.25, "reused_tokens": 7}})
        elif self.path == "/health_generate":
            self._send(200, {})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"null")
        type(self).requests.append((self.path, body))
        if self.path == "/flush_cache":
            if type(self).flush_refusals > 0:
                type(self).flush_refusals -= 1
                self._send(400, {"detail": "requests are running"})
            else:
                self._send(200, {})
        elif self.path == "/generate" and body.get("stream"):
            self._stream(body)
        elif self.path == "/generate":
            n = len(body["input_ids"]) - body["logprob_start_len"]
            entries = [[None, body["input_ids"][body["logprob_start_len"]], None]]
            entries += [[-0.1 * k, t, None] for k, t in enumerate(body["input_ids"][-(n - 1) :])]
            self._send(200, {"text": "x", "meta_info": {"input_token_logprobs": entries}})
        else:
            self._send(404, {})

    def _stream(self, body: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        silent = body["input_ids"][0] == 0  # a prompt starting with 0 gets no token back
        try:
            self.wfile.write(b": keep-alive comment\n\n")
            self.wfile.write(_chunk("", 0, []))  # no token yet
            self.wfile.flush()
            if silent:
                self.wfile.write(b"data: [DONE]\n\n")
                return
            time.sleep(FIRST_TOKEN_DELAY_S)
            self.wfile.write(_chunk(" Hello", 1, [11]))
            self.wfile.flush()
            time.sleep(TAIL_DELAY_S if body["sampling_params"]["max_new_tokens"] > 2 else 0)
            self.wfile.write(_chunk(" Hello world", 2, [11, 12]))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.write(_chunk(" after done", 3, [11, 12, 13]))  # never read
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client closed the stream early


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SGLangLike)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def url(server_url: str) -> str:
    _SGLangLike.requests = []
    _SGLangLike.flush_refusals = 0
    _SGLangLike.semblend = True
    return server_url


def test_sse_events_reads_data_lines_up_to_done() -> None:
    lines = ["", ": comment", 'data: {"a": 1}', "event: x", 'data:{"b": 2}', "data: [DONE]"]
    assert list(sse_events([*lines, 'data: {"c": 3}'])) == [{"a": 1}, {"b": 2}]
    with pytest.raises(json.JSONDecodeError):
        list(sse_events(["data: {not json"]))


def test_stream_generate_times_the_first_token_and_reads_the_whole_answer(url: str) -> None:
    got = stream_generate(url, [5, 6, 7], 2, return_logprob=True)
    assert FIRST_TOKEN_DELAY_S <= got.ttft_s < FIRST_TOKEN_DELAY_S + 2.0
    assert got.text == " Hello world" and got.completion_tokens == 2  # [DONE] ends the read
    assert got.meta["cached_tokens"] == 2
    path, body = _SGLangLike.requests[-1]
    assert path == "/generate" and body["stream"] is True and body["return_logprob"] is True
    assert body["input_ids"] == [5, 6, 7]
    assert body["sampling_params"] == {"max_new_tokens": 2, "temperature": 0.0}
    stream_generate(url, [5], 2)
    assert "return_logprob" not in _SGLangLike.requests[-1][1]


def test_stream_generate_can_stop_at_the_first_token(url: str) -> None:
    started = time.perf_counter()
    got = stream_generate(url, [5, 6, 7], 8, stop_after_first_token=True)
    assert time.perf_counter() - started < TAIL_DELAY_S  # did not wait for the rest
    assert got.text == " Hello" and got.completion_tokens == 1


def test_stream_generate_without_a_token_raises(url: str) -> None:
    with pytest.raises(NoTokenStreamed, match="no token streamed"):
        stream_generate(url, [0, 1], 2)


def test_server_client_answer_and_reference_logprobs(url: str) -> None:
    client = ServerClient(url + "/")
    answer = client.generate([5, 6, 7], 2)
    assert answer.output_ids == (11, 12) and answer.text == " Hello world"
    assert (answer.prompt_tokens, answer.cached_tokens) == (5, 2)
    assert client.reference_logprobs([1, 2, 3], [8, 9]) == pytest.approx([0.0, -0.1])
    _, body = _SGLangLike.requests[-1]
    assert body["input_ids"] == [1, 2, 3, 8, 9] and body["logprob_start_len"] == 2
    assert client.snapshot() == {"hook_seconds": 0.25, "reused_tokens": 7}


def test_flush_retries_until_the_server_applies_it(url: str) -> None:
    _SGLangLike.flush_refusals = 2
    assert try_flush(url) is False
    flush_cache(url, attempts=5, interval_s=0.01)  # refused once more, then applied
    assert [p for p, _ in _SGLangLike.requests] == ["/flush_cache"] * 3
    _SGLangLike.flush_refusals = 3
    with pytest.raises(RuntimeError, match="refused 2 times"):
        flush_cache(url, attempts=2, interval_s=0.01)


def test_snapshot_and_health(url: str) -> None:
    assert semblend_snapshot(url) == {"hook_seconds": 0.25, "reused_tokens": 7}
    assert health_generate(url) is True
    assert health_generate("http://127.0.0.1:1", timeout=2.0) is False  # nothing listens
    _SGLangLike.semblend = False  # a vanilla server has no semblend route
    assert semblend_snapshot(url) is None
    with pytest.raises(httpx.HTTPStatusError):
        stream_generate(url + "/nope", [5], 2)
