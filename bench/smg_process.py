"""The SMG gateway as a child process: ``smg launch`` on loopback ports over running SGLang
workers, ready once it lists every worker healthy, started again on other ports when a port it
was given is taken, stopped with the bench. Used by ``bench gateway``
(:mod:`semblend_sglang.bench.gateway`) and the gateway tests; it sends no request of its own
but ``GET /workers``."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..process_groups import stop as stop_processes
from ..process_groups import track

GATEWAY_HEALTH_ARGS = (
    "--health-check-endpoint",
    "/model_info",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "2",
    "--health-check-timeout-secs",
    "5",
    "--cb-failure-threshold",
    "2",
    "--retry-max-retries",
    "10",
)
"""A stopped instance leaves the rotation within about two seconds: health checks every second
against ``/model_info`` (answered by SGLang's HTTP process at once, however busy the scheduler:
SGLang's ``/health`` runs a generation and times out behind a long CPU prefill, which would mark
a busy instance unhealthy), unhealthy after two failures, a circuit breaker that opens after two
failed requests, and up to 10 retries (exponential backoff from 50 ms, about 6 s in all) for the
requests sent in between; a retry re-places a key whose worker is unavailable."""


class GatewayError(RuntimeError):
    """SMG could not be started or did not become ready."""


@dataclass
class Gateway:
    """A running ``smg launch`` process on loopback (``url``), its log at ``log_path``."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def stop(self, grace: float = 10.0) -> None:
        """Terminate SMG (kill after ``grace`` seconds); idempotent."""
        stop_processes([self.process], grace)


def smg_binary() -> str:
    """The ``smg`` command of this environment (beside its Python, else on PATH);
    GatewayError when smg is not installed."""
    here = Path(sys.executable).parent / "smg"
    found = str(here) if here.exists() else shutil.which("smg")
    if found is None:
        raise GatewayError("smg is not installed (pip install --no-deps smg==1.13.0)")
    return found


GATEWAY_BIND_FAILURE = "Address already in use"
"""What SMG 1.13.0 prints, before exiting with status 1, when its HTTP or metrics port is
taken (another process bound it after :func:`semblend_sglang.server.free_port` chose it)."""


def start_gateway(
    worker_urls: Sequence[str],
    policy_args: Sequence[str],
    log_path: Path,
    timeout: float = 120.0,
    attempts: int = 3,
) -> Gateway:
    """Start SMG on free loopback ports over ``worker_urls`` with ``policy_args`` (and
    :data:`GATEWAY_HEALTH_ARGS`); return once its ``GET /workers`` lists every worker as
    healthy. When SMG exits because a port it was given is taken
    (:data:`GATEWAY_BIND_FAILURE`), it is started again on other ports, ``attempts`` starts in
    all; every start's output is appended to ``log_path``. GatewayError (the process stopped)
    when it does not become ready within ``timeout`` s of its start, or fails otherwise."""
    attempt = 1
    while True:
        start = log_path.stat().st_size if log_path.exists() else 0
        try:
            return _start_gateway_once(worker_urls, policy_args, log_path, timeout)
        except GatewayError:
            text = log_path.read_bytes()[start:].decode(errors="replace")
            if attempt >= attempts or GATEWAY_BIND_FAILURE not in text:
                raise
        attempt += 1


def _start_gateway_once(
    worker_urls: Sequence[str], policy_args: Sequence[str], log_path: Path, timeout: float
) -> Gateway:
    """One start of SMG for :func:`start_gateway` on newly chosen ports, its output appended to
    ``log_path``; GatewayError, the process stopped, when it is not ready within ``timeout``."""
    from ..server import free_port

    port = free_port()
    command = [
        smg_binary(),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        *policy_args,
        *GATEWAY_HEALTH_ARGS,
        "--prometheus-port",
        str(free_port()),
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    # Stopped with the bench on SIGTERM, SIGINT or exit, as its SGLang servers are.
    track(process, own_group=False, polite=signal.SIGTERM)
    gateway = Gateway(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if _healthy_workers(gateway.url) >= len(worker_urls):
            return gateway
        time.sleep(0.5)
    gateway.stop()
    tail = log_path.read_text(errors="replace")[-2000:]
    raise GatewayError(f"smg did not become ready with {len(worker_urls)} workers:\n{tail}")


def _healthy_workers(url: str) -> int:
    """Workers SMG at ``url`` reports healthy (``GET /workers``); 0 when it does not answer."""
    try:
        answer = httpx.get(url + "/workers", timeout=2.0)
        if answer.status_code != 200:
            return 0
        workers = answer.json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(1 for w in workers if w.get("is_healthy", True))
