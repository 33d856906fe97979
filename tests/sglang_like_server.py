"""A small real HTTP server in the test process that answers the SGLang routes the bench uses,
the way sglang 0.5.23 shapes them, for tests of the bench's client and report code that need
no engine (the real engine runs in tests/test_bench_e2e.py's quick run).

Routes: ``POST /generate`` streamed (server-sent events: a comment line, a chunk with no token
yet, then one cumulative chunk per output token, ``data: [DONE]``, and one more chunk that a
client must never read) or not (teacher-forced input logprobs from ``logprob_start_len``);
``POST /flush_cache`` (refused ``flush_refusals`` times first); ``GET /health_generate``; and,
when ``semblend`` is set, ``GET /semblend/snapshot`` with counters a semblend server keeps and
the settings it resolved (``config``; ``config=None`` and ``recompute_counter=False`` answer
like a server from before the recompute budget: no ``config``, no ``recomputed_tokens``).

Behaviour: a prompt's ``cached_tokens`` is its longest common prefix with a prompt seen since
the last flush (SGLang's exact prefix cache). On a semblend server a streamed prompt whose last
:data:`MIN_REUSE` tokens or more equal the end of an earlier prompt counts as ``materialized``
with that common suffix reused, less the ``config``'s ``recompute_ratio`` of it (rounded down),
which counts as recomputed; else ``declined`` (``no_donor``). A prompt that would materialize
but that ``gated`` accepts is declined (``quality_gate``) with the whole suffix recomputed. Time
to the first token is ``first_token_delay_s`` plus ``prefill_s_per_token`` per token neither
cached nor reused. Output tokens depend on the prompt only; a prompt starting with token 0 gets
no token back.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from semblend_sglang.bench.e2e_summary import RECOMPUTE_SETTINGS
from semblend_sglang.config import Config

MIN_REUSE = 32
VOCAB = 49152
RESOLVED_KEYS = ("enabled", "mode", *RECOMPUTE_SETTINGS)
RESOLVED_CONFIG: dict[str, Any] = {
    key: value for key, value in Config().as_dict().items() if key in RESOLVED_KEYS
}
"""The default ``config`` of the snapshot (a part of ``Config.as_dict()``)."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def output_ids(prompt: Sequence[int], n: int) -> list[int]:
    """The ``n`` output token ids the server gives ``prompt``."""
    return [(sum(prompt) + 7 * k) % VOCAB for k in range(n)]


def top2_margin(token: int) -> float:
    """The top-1 / top-2 logprob margin the server reports at an output position whose token
    is ``token`` (when asked with ``top_logprobs_num`` >= 2)."""
    return 0.01 * (token % 50)


@dataclass
class ServerState:
    """What one server does and has seen; tests set the first fields and read the rest."""

    semblend: bool = True
    first_token_delay_s: float = 0.0
    tail_delay_s: float = 0.0
    """Pause after the first token when more than two were asked for."""
    prefill_s_per_token: float = 0.0
    flush_refusals: int = 0
    config: dict[str, Any] | None = field(default_factory=lambda: dict(RESOLVED_CONFIG))
    recompute_counter: bool = True
    gated: Callable[[tuple[int, ...]], bool] = lambda prompt: False
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cache: list[tuple[int, ...]] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    declined: Counter[str] = field(default_factory=Counter)
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    hook_seconds: float = 0.0
    copy_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, prompt: tuple[int, ...]) -> tuple[int, int]:
        """(cached tokens, reused tokens) of a streamed prompt; counts its outcome."""
        with self.lock:
            cached = max((_common_prefix(prompt, c) for c in self.cache), default=0)
            cached = min(cached, len(prompt) - 1)
            reused = 0
            if self.semblend:
                suffix = max((_common_prefix(prompt[::-1], c[::-1]) for c in self.cache), default=0)
                reused = min(suffix, len(prompt) - cached - 1)
                if reused >= MIN_REUSE and self.gated(prompt):
                    self.recomputed_tokens += reused
                    reused = 0
                    self.outcomes["declined"] += 1
                    self.declined["quality_gate"] += 1
                elif reused >= MIN_REUSE:
                    ratio = float((self.config or {}).get("recompute_ratio", 0.0))
                    recomputed = int(ratio * reused)
                    reused -= recomputed
                    self.recomputed_tokens += recomputed
                    self.outcomes["materialized"] += 1
                    self.reused_tokens += reused
                    self.copy_seconds += 0.0003
                else:
                    reused = 0
                    self.outcomes["declined"] += 1
                    self.declined["no_donor"] += 1
                self.hook_seconds += 0.0005
            self.cache.append(prompt)
            return cached, reused


class _Handler(BaseHTTPRequestHandler):
    server: SGLangLikeServer

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
        state = self.server.state
        if self.path == "/semblend/snapshot" and state.semblend:
            with state.lock:
                total = {
                    "outcomes": dict(state.outcomes),
                    "declined": dict(state.declined),
                    "reused_tokens": state.reused_tokens,
                    "hook_seconds": state.hook_seconds,
                    "copy_seconds": state.copy_seconds,
                }
                if state.recompute_counter:
                    total["recomputed_tokens"] = state.recomputed_tokens
            body: dict[str, Any] = {"ranks": [total], "total": total}
            if state.config is not None:
                body["config"] = state.config
            self._send(200, body)
        elif self.path == "/health_generate":
            self._send(200, {})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["content-length"] or 0)) or b"null")
        state.requests.append((self.path, body))
        if self.path == "/flush_cache":
            with state.lock:
                refuse = state.flush_refusals > 0
                state.flush_refusals -= int(refuse)
                if not refuse:
                    state.cache.clear()
            self._send(400 if refuse else 200, {})
        elif self.path == "/generate" and body.get("stream"):
            self._stream(body)
        elif self.path == "/generate":
            ids, start = body["input_ids"], body["logprob_start_len"]
            entries: list[list[Any]] = [[None, ids[start], None]]
            entries += [[-0.1 * (k % 5) - 0.1, t, None] for k, t in enumerate(ids[start + 1 :])]
            self._send(200, {"text": "", "meta_info": {"input_token_logprobs": entries}})
        else:
            self._send(404, {"detail": "Not Found"})

    def _chunk(self, meta: dict[str, Any], ids: list[int], logprobs: bool, top: int = 0) -> bytes:
        meta = dict(meta, completion_tokens=len(ids))
        if logprobs:
            meta["output_token_logprobs"] = [[-0.5, i, None] for i in ids]
            if top >= 2:
                meta["output_top_logprobs"] = [
                    [[-0.5, i, None], [-0.5 - top2_margin(i), (i + 1) % VOCAB, None]] for i in ids
                ]
        text = "".join(f" t{i}" for i in ids)
        return b"data: " + json.dumps({"text": text, "meta_info": meta}).encode() + b"\n\n"

    def _stream(self, body: dict[str, Any]) -> None:
        state = self.server.state
        prompt = tuple(body["input_ids"])
        n = int(body["sampling_params"]["max_new_tokens"])
        logprobs = bool(body.get("return_logprob"))
        top = int(body.get("top_logprobs_num") or 0)
        cached, reused = state.admit(prompt)
        meta = {"prompt_tokens": len(prompt), "cached_tokens": cached}
        out = output_ids(prompt, n)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        try:
            self.wfile.write(b": keep-alive\n\n" + self._chunk(meta, [], logprobs))
            self.wfile.flush()
            if prompt[0] == 0:
                self.wfile.write(b"data: [DONE]\n\n")
                return
            computed = len(prompt) - cached - reused
            time.sleep(state.first_token_delay_s + state.prefill_s_per_token * computed)
            for k in range(1, n + 1):
                self.wfile.write(self._chunk(meta, out[:k], logprobs, top))
                self.wfile.flush()
                if k == 1 and n > 2:
                    time.sleep(state.tail_delay_s)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.write(self._chunk(meta, [*out, 1], logprobs))  # after [DONE]: never read
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client closed the stream early


class SGLangLikeServer(ThreadingHTTPServer):
    """The server; ``state`` may be replaced between requests (a fresh server)."""

    daemon_threads = True

    def __init__(self, state: ServerState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def serve(state: ServerState) -> Iterator[SGLangLikeServer]:
    """Run a server with ``state`` on a free loopback port in a thread until the block ends."""
    server = SGLangLikeServer(state)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
