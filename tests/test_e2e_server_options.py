"""End to end: server options a user may set, on the real SGLang 0.5.23 CPU server with the
plugin. ``--chunked-prefill-size -1`` serves semantic hits (the chunk-cut path that once raised
inside SGLang's ``PrefillBudget`` is gone); ``--disable-radix-cache`` is named once at start-up
and no request is looked up (and ``/semblend/snapshot`` needs ``--admin-api-key`` when one is
set, as SGLang's admin endpoints do); a bad ``SEMBLEND_*`` value stops the server at start
naming the key.

The two option servers are started together, the first handed a taken port: the test of a
start on a taken port reads that start, and the option tests use the servers it left healthy
(two real starts fewer than a start per test).

SGLang checks its pools when idle and raises on a leak (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE,
on by default): a server still healthy after idling is one whose invariants held.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.server import ServerError, ServerSpec, SglangServer, free_port
from tests.harness.server import generate, taken_port

pytestmark = pytest.mark.e2e

ADMIN_KEY = "semblend-admin-test-key"
INSTRUCTIONS = (
    "Summarize the following essay in three sentences.\n\n",
    "Read the essay below carefully and list the author's main arguments.\n\n",
)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any, essay_texts: list[str]) -> tuple[list[int], list[int]]:
    enc = smollm2_tokenizer.encode
    doc = enc(essay_texts[1], add_special_tokens=False)[:900]
    return (
        enc(INSTRUCTIONS[0], add_special_tokens=False) + doc,
        enc(INSTRUCTIONS[1], add_special_tokens=False) + doc,
    )


def _rank(url: str, key: str | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url + "/semblend/snapshot")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=60) as resp:
        snap = json.loads(resp.read().decode())
    (rank,) = snap["ranks"]
    assert rank is not None
    rank_snap: dict[str, Any] = rank
    return rank_snap


def _healthy_after_idle(server: SglangServer) -> None:
    time.sleep(1)  # the scheduler's idle self-check runs on its first idle loop; a leak kills it
    assert server.alive()
    with urllib.request.urlopen(server.url + "/health_generate", timeout=300) as resp:
        assert resp.status == 200


UNCHUNKED_ARGS = [
    "--chunked-prefill-size", "-1",
    # SGLang's CPU memory rule leaves nothing for KV with chunked prefill off unless the
    # fraction is given (the reproduction passed 0.8); the pool is bounded in tokens
    "--mem-fraction-static", "0.8", "--max-total-tokens", "32768",
]  # fmt: skip
NO_RADIX_ARGS = ["--disable-radix-cache", "--admin-api-key", ADMIN_KEY]


@contextmanager
def recording_starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[SglangServer]]:
    """Every server ``semblend_sglang.server.start_healthy`` starts inside the block, in order:
    its ``start_server`` is wrapped to record them."""
    import semblend_sglang.server as server_module

    recorded: list[SglangServer] = []
    real_start: Callable[..., SglangServer] = server_module.start_server

    def recorded_start(*args: Any, **kw: Any) -> SglangServer:
        recorded.append(real_start(*args, **kw))
        return recorded[-1]

    monkeypatch.setattr(server_module, "start_server", recorded_start)
    yield recorded


@dataclass(frozen=True)
class OptionServers:
    """The module's two servers as ``start_healthy`` returned them, with every start it made
    (``started``) and the ports it was handed (``handed``: the taken one first)."""

    unchunked: SglangServer
    no_radix: SglangServer
    started: list[SglangServer]
    handed: list[int]


@pytest.fixture(scope="module")
def option_servers(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OptionServers]:
    """The unchunked server (:data:`UNCHUNKED_ARGS`) and the no-radix one (:data:`NO_RADIX_ARGS`),
    started together by ``start_healthy`` with the first handed a taken port: it is stopped on
    PortInUseError from its log and started again on another port (each wait is cut to 120 s,
    so a start that waited it out raises ServerError). Three starts, two servers kept."""
    import semblend_sglang.server as server_module

    logs = tmp_path_factory.mktemp("option-servers")
    env = {"SEMBLEND_ENABLED": "1"}
    specs = [
        ServerSpec(smollm2_model_dir, UNCHUNKED_ARGS, env=env, log_path=logs / "unchunked.log"),
        ServerSpec(smollm2_model_dir, NO_RADIX_ARGS, env=env, log_path=logs / "no-radix.log"),
    ]
    with taken_port() as taken, pytest.MonkeyPatch.context() as monkeypatch:
        handed = [taken, free_port(), free_port()]
        ports = iter(handed)
        monkeypatch.setattr(server_module, "free_port", lambda host="127.0.0.1": next(ports))
        with recording_starts(monkeypatch) as started:
            unchunked, no_radix = server_module.start_healthy(specs, timeout=120.0)
    try:
        yield OptionServers(unchunked, no_radix, started, handed)
    finally:
        unchunked.stop()
        no_radix.stop()


@pytest.fixture(scope="module")
def unchunked(option_servers: OptionServers) -> SglangServer:
    return option_servers.unchunked


def test_chunked_prefill_off_serves_a_semantic_hit_like_cold(
    unchunked: SglangServer, prompts: tuple[list[int], list[int]]
) -> None:
    donor, probe = prompts
    generate(unchunked.url, donor, 1)
    before = _rank(unchunked.url)
    reused = generate(unchunked.url, probe, 8)
    after = _rank(unchunked.url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1, after
    copied = after["reused_tokens"] + after.get("recomputed_tokens", 0)
    assert copied - before["reused_tokens"] - before.get("recomputed_tokens", 0) >= 800
    cold = generate(unchunked.url, probe, 8, cache_salt="cold")
    assert cold["meta_info"]["cached_tokens"] == 0
    got, want = reused["output_ids"], cold["output_ids"]
    agree = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))
    assert agree >= 4, (got, want)
    _healthy_after_idle(unchunked)


def test_disabled_radix_cache_is_named_at_start_and_nothing_is_looked_up(
    option_servers: OptionServers, prompts: tuple[list[int], list[int]]
) -> None:
    srv = option_servers.no_radix
    for ids in prompts:
        answer = generate(srv.url, ids, 4)
        assert answer["meta_info"]["completion_tokens"] == 4
    # the snapshot follows SGLang's admin rule: with --admin-api-key it needs the key
    with pytest.raises(urllib.error.HTTPError) as denied:
        _rank(srv.url)
    assert denied.value.code == 401
    rank = _rank(srv.url, ADMIN_KEY)
    assert rank["lookups"] == 0 and rank["donors"] == 0, rank
    assert rank["unsupported_options"][0].startswith("--disable-radix-cache"), rank
    assert rank["reuse_off"] == rank["unsupported_options"], rank
    request = urllib.request.Request(srv.url + "/semblend/snapshot")
    request.add_header("Authorization", f"Bearer {ADMIN_KEY}")
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert json.loads(resp.read().decode())["reuse_off"] == rank["reuse_off"]
    assert srv.log_path is not None
    text = srv.log_path.read_text(errors="replace")
    assert text.count("unsupported server options: --disable-radix-cache") == 1
    _healthy_after_idle(srv)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[SglangServer]]:
    """Every server ``start_healthy`` starts during the test, in order
    (:func:`recording_starts`)."""
    with recording_starts(monkeypatch) as recorded:
        yield recorded


def test_a_bad_setting_stops_the_server_at_start_naming_the_key_and_its_peer_is_stopped(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, started: list[SglangServer]
) -> None:
    """A server with a bad SEMBLEND_* value exits at start naming the key; start_healthy, which
    started a good server beside it, raises that ServerError and stops the good one too."""
    import semblend_sglang.server as server_module

    logs = tmp_path_factory.mktemp("bad-config")
    bad = {"SEMBLEND_ENABLED": "1", "SEMBLEND_MIN_REUSE_RATIO": "2.5"}
    specs = [
        ServerSpec(smollm2_model_dir, env=bad, log_path=logs / "bad.log"),
        ServerSpec(smollm2_model_dir, env={"SEMBLEND_ENABLED": "1"}, log_path=logs / "good.log"),
    ]
    with pytest.raises(ServerError, match="exited"):
        server_module.start_healthy(specs, timeout=600)
    assert "SEMBLEND_MIN_REUSE_RATIO" in (logs / "bad.log").read_text(errors="replace")
    assert len(started) == 2 and not any(s.alive() for s in started)


def test_a_taken_port_fails_fast_and_only_its_server_starts_again_on_another(
    option_servers: OptionServers,
) -> None:
    """Two servers started together, the first handed a taken port (:func:`option_servers`):
    start_healthy stopped it on PortInUseError and started it again on the next port; the
    second, on its own port, was started once and kept. Three starts; both serve."""
    started, handed = option_servers.started, option_servers.handed
    assert [s.url.rsplit(":", 1)[1] for s in started] == [str(p) for p in handed]
    servers = [option_servers.unchunked, option_servers.no_radix]
    assert [s.url for s in servers] == [started[2].url, started[1].url]
    assert not started[0].alive(), "the start on the taken port was not stopped"
    for server in servers:
        answer = generate(server.url, [1, 2, 3, 4], 2)
        assert answer["meta_info"]["completion_tokens"] == 2
