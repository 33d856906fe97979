"""The real SGLang server for end-to-end tests: started on a free port, healthy, stopped."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from semblend_sglang.server import PortInUseError, SglangServer, free_port, start_server

HEALTHY_WITHIN_S = 600.0
"""How long a test server may take to load and answer ``/health`` (a loaded 2-core CI box)."""

PORT_ATTEMPTS = 3
"""Starts on fresh ports before a port taken at start-up (PortInUseError) fails the test."""

PORT_TAKEN_GRACE_S = 5.0
"""SIGINT-to-SIGKILL grace for a start whose port was taken: its launcher hangs, it never serves."""


@contextmanager
def healthy_server(
    model_dir: Path,
    log: Path,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[SglangServer]:
    """The real server of ``model_dir`` with ``env`` and ``extra_args``, its output in ``log``,
    healthy when yielded; its whole process group is stopped on exit, also when it never became
    healthy (the ServerError then carries the log's tail). A start whose port was taken is
    stopped and repeated on another port, up to :data:`PORT_ATTEMPTS` starts. Test fixtures
    call it."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        server = start_server(
            model_dir, port=free_port(), extra_args=extra_args, env=env, log_path=log
        )
        try:
            server.wait_healthy(timeout=HEALTHY_WITHIN_S)
            break
        except PortInUseError:
            server.stop(grace=PORT_TAKEN_GRACE_S)
            if attempt == PORT_ATTEMPTS:
                raise
        except BaseException:
            server.stop()
            raise
    try:
        yield server
    finally:
        server.stop()
