"""The real SGLang server for end-to-end tests: started on a free port, healthy, stopped."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from semblend_sglang.server import SglangServer, free_port, start_server

HEALTHY_WITHIN_S = 600.0
"""How long a test server may take to load and answer ``/health`` (a loaded 2-core CI box)."""


@contextmanager
def healthy_server(
    model_dir: Path,
    log: Path,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[SglangServer]:
    """The real server of ``model_dir`` with ``env`` and ``extra_args``, its output in ``log``,
    healthy when yielded; its whole process group is stopped on exit, also when it never became
    healthy (the ServerError then carries the log's tail). Test fixtures call it."""
    with start_server(
        model_dir, port=free_port(), extra_args=extra_args, env=env, log_path=log
    ) as server:
        server.wait_healthy(timeout=HEALTHY_WITHIN_S)
        yield server
