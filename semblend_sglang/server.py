"""Starts and stops the real SGLang HTTP server as a child process group.

Used by ``semblend-sglang serve`` (``make serve``), the benchmarks and the end-to-end tests. On a
machine without CUDA the server runs on SGLang's CPU engine with the flags of docs/architecture.md
and the CPU runtime (:mod:`semblend_sglang.cpu_runtime`) in its environment, so the spawned
scheduler and detokenizer get it too. Nothing here talks to sglang in-process.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from . import process_groups
from .cpu_runtime import cuda_available, runtime_environ

CPU_SERVER_FLAGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--grammar-backend",
    "none",
    "--dtype",
    "float32",
    "--sleep-on-idle",
    "--max-total-tokens",
    "65536",
)
"""Flags that make SGLang 0.5.23 serve on a CPU without AMX (why each: docs/cpu.md)."""


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message carries its last log lines."""


class PortInUseError(ServerError):
    """The server could not bind its HTTP port: another socket took it after :func:`free_port`
    chose it (SGLang's own start-up picks free ports too). Starting again on another port is
    the remedy; SGLang's launcher does not exit on it, so without this it would wait out the
    health timeout."""


BIND_FAILURE = "error while attempting to bind on address"
"""What uvicorn logs when the HTTP port is taken (followed by the address and the errno text)."""
HEALTH_POLL_S = 0.25
"""How often :meth:`SglangServer.wait_healthy` asks ``/health`` (and reads the log for a taken
port) while a server starts: a start lasts 30 s or more; a start is seen half a poll late on
average."""


def _flag_names(args: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def build_server_command(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    extra_args: Sequence[str] = (),
    cpu: bool | None = None,
) -> list[str]:
    """Command line of ``python -m sglang.launch_server`` for this machine.

    ``cpu=None`` decides by :func:`cuda_available`. CPU defaults are added only for flags the
    caller did not pass in ``extra_args``, so any of them can be overridden.
    """
    if cpu is None:
        cpu = not cuda_available()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path)]
    cmd += ["--host", host, "--port", str(port)]
    if cpu:
        given = _flag_names(extra_args)
        i = 0
        while i < len(CPU_SERVER_FLAGS):
            flag = CPU_SERVER_FLAGS[i]
            takes_value = i + 1 < len(CPU_SERVER_FLAGS) and not CPU_SERVER_FLAGS[i + 1].startswith(
                "--"
            )
            if flag not in given:
                cmd += [flag, CPU_SERVER_FLAGS[i + 1]] if takes_value else [flag]
            i += 2 if takes_value else 1
    cmd += list(extra_args)
    return cmd


def server_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the server process: the CPU runtime (no CUDA only) and offline hub."""
    env = runtime_environ(base)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def dp_size_of(args: Sequence[str]) -> int:
    """The ``--dp-size`` (alias ``--data-parallel-size``) among sglang flags ``args``; 1 if
    absent. Accepts ``--dp-size N`` and ``--dp-size=N``; raises ValueError for a non-integer."""
    names = ("--dp-size", "--data-parallel-size")
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name in names:
            return int(value if sep else args[i + 1])
    return 1


def cpu_dp_environ(args: Sequence[str], cpu: bool | None = None) -> dict[str, str]:
    """Variables a CPU server started with ``args`` needs for data parallelism: with
    ``--dp-size N`` (N >= 2) and no CUDA, ``SGLANG_CPU_OMP_THREADS_BIND`` giving rank ``i``
    core ``i`` modulo this machine's cores (``"0|1"`` for 2 ranks): without it every rank binds
    all cores and the ranks contend. Empty otherwise, and when the variable is already set in
    this process's environment (the caller's choice wins). ``cpu=None``: no CUDA."""
    n = dp_size_of(args)
    if cpu is None:
        cpu = not cuda_available()
    if n < 2 or not cpu or "SGLANG_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = os.cpu_count() or 1
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i % cores) for i in range(n))}


def http_json(url: str, payload: Any | None = None, timeout: float = 600.0) -> Any:
    """GET (payload None) or POST JSON to ``url`` and decode the JSON answer."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"content-type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode() or "null")


@dataclass
class SglangServer:
    """A running ``sglang.launch_server`` in its own process group.

    Create with :func:`start_server`. :meth:`stop` ends the whole group (server, scheduler,
    detokenizer): SIGINT first, SIGKILL after ``grace`` seconds. Also a context manager.
    """

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path | None
    command: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        """True while the launcher process has not exited."""
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """Last lines of the server log (empty when the log goes to the terminal)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def port_taken(self) -> bool:
        """True when the log shows the HTTP port could not be bound (False without a log)."""
        if self.log_path is None or not self.log_path.exists():
            return False
        port = self.url.rsplit(":", 1)[1]
        text = self.log_path.read_text(errors="replace")
        return any(BIND_FAILURE in line and port in line for line in text.splitlines())

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Block until ``GET /health`` answers 200; :class:`PortInUseError` as soon as the log
        shows the port taken, ServerError if the server dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(
                    f"sglang server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if self.port_taken():
                raise PortInUseError(f"{self.url}: port in use:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError):
                pass  # not listening yet, or a reply that is no HTTP: ask again
            time.sleep(HEALTH_POLL_S)
        raise ServerError(f"sglang server not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, grace: float = 20.0) -> int:
        """Stop the server and every process of its group; returns the launcher's exit code.
        Idempotent: a second call only returns the code.

        SIGINT goes to the launcher only (it shuts its scheduler and detokenizer down itself);
        the group is killed once the launcher has exited or ``grace`` seconds have passed, so
        nothing that outlived it (scheduler, detokenizer) is left
        (:func:`semblend_sglang.process_groups.stop`)."""
        process_groups.stop([self.process], grace)
        return int(self.process.returncode or 0)

    def __enter__(self) -> SglangServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def start_server(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
) -> SglangServer:
    """Start the real SGLang server (not waiting for health; see :meth:`SglangServer.wait_healthy`).

    ``env`` overrides variables on top of :func:`server_environ`. With ``log_path`` the server's
    stdout and stderr go to that file, else to this process's terminal. The server runs in its
    own process group, registered with :mod:`semblend_sglang.process_groups`: it is stopped when
    this process exits or gets SIGTERM or SIGINT, if :meth:`SglangServer.stop` has not run.
    """
    command = build_server_command(model_path, host, port, extra_args)
    full_env = server_environ()
    full_env.update(env or {})
    out: IO[bytes] | None = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = log_path.open("wb")
    try:
        process = subprocess.Popen(
            command,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        if out is not None:
            out.close()
    process_groups.track(process, own_group=True, polite=signal.SIGINT)
    return SglangServer(
        process=process, url=f"http://{host}:{port}", log_path=log_path, command=command
    )


PORT_ATTEMPTS = 3
"""Starts of one server, each on a fresh port, before a port taken at start-up
(:class:`PortInUseError`) is raised."""

PORT_TAKEN_GRACE_S = 5.0
"""SIGINT-to-SIGKILL grace for a start whose port was taken: its launcher hangs, it never serves."""


@dataclass(frozen=True)
class ServerSpec:
    """One server for :func:`start_healthy`: :func:`start_server`'s arguments but the port."""

    model_path: str | Path
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] | None = None
    log_path: Path | None = None
    host: str = "127.0.0.1"


def _start_on_free_port(spec: ServerSpec) -> SglangServer:
    return start_server(
        spec.model_path,
        host=spec.host,
        port=free_port(spec.host),
        extra_args=spec.extra_args,
        env=spec.env,
        log_path=spec.log_path,
    )


def start_healthy(
    specs: Sequence[ServerSpec], timeout: float, attempts: int = PORT_ATTEMPTS
) -> list[SglangServer]:
    """Start one server per spec, each on a :func:`free_port`, all before waiting; return them
    healthy, in the order of ``specs``. ``timeout``: seconds each wait may take.

    A port is only free when chosen: another server starting beside it (SGLang picks its own
    free ports while it starts) can bind it first. A server whose port was taken
    (:class:`PortInUseError`) is stopped and started again on another port, up to ``attempts``
    starts; the others keep running. On any other failure, or the last attempt's, every server
    started here is stopped and the error re-raised. The benches, the tests' harness and the
    scripts start servers through it."""
    servers: list[SglangServer] = []
    try:
        for spec in specs:
            servers.append(_start_on_free_port(spec))
        for i, spec in enumerate(specs):
            for attempt in range(1, attempts + 1):
                try:
                    servers[i].wait_healthy(timeout=timeout)
                    break
                except PortInUseError:
                    servers[i].stop(grace=PORT_TAKEN_GRACE_S)
                    if attempt == attempts:
                        raise
                    servers[i] = _start_on_free_port(spec)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Linux's range of client (ephemeral) ports."""
LOWEST_SERVER_PORT = 20000
"""Lowest port :func:`free_port` hands out."""
HIGHEST_SERVER_PORT = 55000
"""Highest port :func:`free_port` hands out: sglang refuses to start when port + 10000 (its
gRPC port) exceeds 65535."""


def _first_ephemeral_port() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, below the OS's ephemeral range.

    Below it, because a client that polls a port nobody listens on yet can be handed that very
    port as its own source port and connect to itself (TCP simultaneous open): its request then
    comes back as the reply. A server port outside the range can never be a client's."""
    import random
    import socket

    top = min(_first_ephemeral_port(), HIGHEST_SERVER_PORT)
    low = LOWEST_SERVER_PORT if top - LOWEST_SERVER_PORT >= 1000 else 1024
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(low, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {top}) on {host}")
