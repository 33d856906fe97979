"""The launcher's port choice and health poll against real sockets.

A client that polls ``/health`` before the server listens can be handed the server's own port as
its source port and connect to itself; its request then comes back as the reply
(``BadStatusLine: GET /health HTTP/1.1``, seen once in CI). ``free_port`` keeps server ports out
of the client range, and ``wait_healthy`` treats a reply that is no HTTP as "not up yet"."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from semblend_sglang.server import (
    HIGHEST_SERVER_PORT,
    SglangServer,
    _first_ephemeral_port,
    free_port,
)


def test_free_ports_lie_below_the_client_range_and_can_be_bound() -> None:
    first_client = _first_ephemeral_port()
    for _ in range(50):
        port = free_port()
        assert port < first_client
        assert port <= HIGHEST_SERVER_PORT
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing in for the launcher (wait_healthy only asks if it is alive)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_reply_that_is_no_http_is_polled_again_until_health_answers(
    sleeper: subprocess.Popen[bytes],
) -> None:
    """First connection: the bytes a self-connected socket reads (its own request line); second
    connection: a 200. wait_healthy must return, not raise BadStatusLine."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", free_port()))
    listener.listen()
    port = listener.getsockname()[1]
    replies = [b"GET /health HTTP/1.1\r\n\r\n", b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"]
    served: list[bytes] = []

    def serve() -> None:
        for reply in replies:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(reply)
                served.append(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    server = SglangServer(process=sleeper, url=f"http://127.0.0.1:{port}", log_path=None)
    try:
        server.wait_healthy(timeout=30)
    finally:
        listener.close()
    thread.join(timeout=5)
    assert served == replies
