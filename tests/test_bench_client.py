"""The bench's one HTTP client (bench/client.py) against a small real HTTP server
in this process that answers like SGLang (tests/sglang_like_server.py): server-sent events from
``/generate``, a refused then applied ``/flush_cache``, ``/semblend/snapshot`` and
``/health_generate``. The client against the real SGLang server is exercised by
tests/test_bench_e2e.py's quick run."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from sglang_like_server import ServerState, SGLangLikeServer, output_ids, serve, top2_margin

from semblend_sglang.bench.client import (
    NoTokenStreamed,
    ServerClient,
    flush_cache,
    health_generate,
    semblend_snapshot,
    sse_events,
    stream_generate,
    top2_margins,
    try_flush,
)

FIRST_TOKEN_DELAY_S = 0.2
TAIL_DELAY_S = 3.0


@pytest.fixture(scope="module")
def server() -> Iterator[SGLangLikeServer]:
    with serve(ServerState()) as running:
        yield running


@pytest.fixture
def state(server: SGLangLikeServer) -> ServerState:
    server.state = ServerState(first_token_delay_s=FIRST_TOKEN_DELAY_S, tail_delay_s=TAIL_DELAY_S)
    return server.state


@pytest.fixture
def url(server: SGLangLikeServer, state: ServerState) -> str:
    return server.url


def test_sse_events_reads_data_lines_up_to_done() -> None:
    lines = ["", ": comment", 'data: {"a": 1}', "event: x", 'data:{"b": 2}', "data: [DONE]"]
    assert list(sse_events([*lines, 'data: {"c": 3}'])) == [{"a": 1}, {"b": 2}]
    with pytest.raises(json.JSONDecodeError):
        list(sse_events(["data: {not json"]))


def test_stream_generate_times_the_first_token_and_reads_the_whole_answer(
    url: str, state: ServerState
) -> None:
    got = stream_generate(url, [5, 6, 7], 2, return_logprob=True)
    assert FIRST_TOKEN_DELAY_S <= got.ttft_s < FIRST_TOKEN_DELAY_S + 2.0
    ids = output_ids([5, 6, 7], 2)
    assert got.text == f" t{ids[0]} t{ids[1]}" and got.completion_tokens == 2  # stops at [DONE]
    assert got.meta["output_token_logprobs"] == [[-0.5, i, None] for i in ids]
    path, body = state.requests[-1]
    assert path == "/generate" and body["stream"] is True and body["return_logprob"] is True
    assert body["input_ids"] == [5, 6, 7]
    assert body["sampling_params"] == {"max_new_tokens": 2, "temperature": 0.0}
    stream_generate(url, [5], 2)
    assert "return_logprob" not in state.requests[-1][1]


def test_stream_generate_can_stop_at_the_first_token(url: str) -> None:
    started = time.perf_counter()
    got = stream_generate(url, [5, 6, 7], 8, stop_after_first_token=True)
    assert time.perf_counter() - started < TAIL_DELAY_S  # did not wait for the rest
    assert got.text == f" t{output_ids([5, 6, 7], 1)[0]}" and got.completion_tokens == 1


def test_stream_generate_without_a_token_raises(url: str) -> None:
    with pytest.raises(NoTokenStreamed, match="no token streamed"):
        stream_generate(url, [0, 1], 2)


def test_server_client_answer_and_reference_logprobs(url: str, state: ServerState) -> None:
    client = ServerClient(url + "/")
    client.generate([5, 6, 7, 8], 1)
    answer = client.generate([5, 6, 7], 2)
    assert answer.output_ids == tuple(output_ids([5, 6, 7], 2))
    assert (answer.prompt_tokens, answer.cached_tokens) == (3, 2)  # the server's own counts
    assert client.reference_logprobs([1, 2, 3], [8, 9]) == pytest.approx([-0.1, -0.2])
    _, body = state.requests[-1]
    assert body["input_ids"] == [1, 2, 3, 8, 9] and body["logprob_start_len"] == 2
    assert client.snapshot() == {
        "outcomes": {"declined": 2},
        "declined": {"no_donor": 2},
        "reused_tokens": 0,
        "recomputed_tokens": 0,
        "hook_seconds": pytest.approx(0.001),
        "copy_seconds": 0.0,  # two declines: nothing copied
    }


def test_server_client_reads_the_top2_margins_only_when_asked(url: str, state: ServerState) -> None:
    client = ServerClient(url)
    plain = client.generate([3, 4], 3)
    assert plain.margins == ()
    _, body = state.requests[-1]
    assert "top_logprobs_num" not in body
    asked = client.generate([3, 4], 3, margins=True)
    _, body = state.requests[-1]
    assert body["top_logprobs_num"] == 2
    assert asked.output_ids == plain.output_ids
    assert asked.margins == pytest.approx([top2_margin(t) for t in asked.output_ids])


def test_top2_margins_refuses_a_position_without_two_candidates() -> None:
    meta = {"output_top_logprobs": [[[-0.1, 5, None], [-0.4, 6, None]], [[-0.2, 7, None]]]}
    with pytest.raises(ValueError, match="position 1 has 1 top logprobs"):
        top2_margins(meta)
    assert top2_margins({"output_top_logprobs": meta["output_top_logprobs"][:1]}) == (
        pytest.approx(0.3),
    )
    assert top2_margins({}) == ()


def test_flush_retries_until_the_server_applies_it(url: str, state: ServerState) -> None:
    state.flush_refusals = 2
    assert try_flush(url) is False
    flush_cache(url, attempts=5, interval_s=0.01)  # refused once more, then applied
    assert [p for p, _ in state.requests] == ["/flush_cache"] * 3
    state.flush_refusals = 3
    with pytest.raises(RuntimeError, match="refused 2 times"):
        flush_cache(url, attempts=2, interval_s=0.01)


def test_snapshot_and_health(url: str, state: ServerState) -> None:
    assert semblend_snapshot(url) == {
        "outcomes": {},
        "declined": {},
        "reused_tokens": 0,
        "recomputed_tokens": 0,
        "hook_seconds": 0.0,
        "copy_seconds": 0.0,
    }
    assert health_generate(url) is True
    assert health_generate("http://127.0.0.1:1", timeout=2.0) is False  # nothing listens
    state.semblend = False  # a vanilla server has no semblend route
    assert semblend_snapshot(url) is None
    with pytest.raises(httpx.HTTPStatusError):
        stream_generate(url + "/nope", [5], 2)
