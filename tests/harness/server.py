"""The real SGLang server for end-to-end tests: started on a free port, healthy, stopped; the
tests' requests to it (one non-streamed ``POST /generate``, semblend's snapshot counters and
its ``/metrics`` series); and a port held taken, for the tests of a start on a taken port."""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from semblend_sglang.bench.client import semblend_snapshot
from semblend_sglang.server import ServerSpec, SglangServer, http_json, start_healthy


@contextmanager
def taken_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` that a listening socket holds until the block ends: a server handed it
    fails to bind it, as when another process took a port chosen free."""
    with socket.socket() as holder:
        holder.bind((host, 0))
        holder.listen()
        yield int(holder.getsockname()[1])


HEALTHY_WITHIN_S = 600.0
"""How long a test server may take to load and answer ``/health`` (a loaded 2-core CI box)."""

SERVER_BATCH = 2
"""How many of a test module's servers :class:`ServerBatches` starts at once."""


@contextmanager
def healthy_server(
    model_dir: Path,
    log: Path,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[SglangServer]:
    """The real server of ``model_dir`` with ``env`` and ``extra_args``, its output in ``log``,
    healthy when yielded; its whole process group is stopped on exit, also when it never became
    healthy (the ServerError then carries the log's tail). Started by
    :func:`semblend_sglang.server.start_healthy` (a port taken at start-up: another port). Test
    fixtures call it."""
    spec = ServerSpec(model_dir, extra_args=extra_args, env=env, log_path=log)
    (server,) = start_healthy([spec], timeout=HEALTHY_WITHIN_S)
    try:
        yield server
    finally:
        server.stop()


class ServerBatches:
    """The real servers one test module needs, started ``size`` at a time.

    ``specs`` names each server, in the order the module's tests first use them; they are cut
    into batches of ``size`` in that order. :meth:`server` returns a healthy server: on the
    first request for a name outside the running batch it stops that batch and starts the
    name's whole batch at once (:func:`semblend_sglang.server.start_healthy`), so on 2 cores the
    batch's imports overlap (docs/perf.md "CI wall time"). Each server keeps its own settings
    and process; an idle one sleeps (``--sleep-on-idle``). A module fixture owns one and calls
    :meth:`stop` at its end. Every server of a batch holds memory (about 3 GB for SmolLM2 with
    the tests' 16,384-token pool) until the batch stops: keep ``size`` small."""

    def __init__(self, specs: Mapping[str, ServerSpec], size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        names = list(specs)
        self._specs = dict(specs)
        self._batches = [names[i : i + size] for i in range(0, len(names), size)]
        self._running: dict[str, SglangServer] = {}

    def server(self, name: str) -> SglangServer:
        """The healthy server named ``name``, its batch started if it is not running."""
        if name not in self._running:
            batch = next(b for b in self._batches if name in b)
            self.stop()
            started = start_healthy([self._specs[n] for n in batch], timeout=HEALTHY_WITHIN_S)
            self._running = dict(zip(batch, started, strict=True))
        return self._running[name]

    def stop(self) -> None:
        """Stop every running server (each process group, also after a failed test)."""
        running, self._running = self._running, {}
        for server in running.values():
            server.stop()


SAMPLING_ARGUMENTS = frozenset({"max_new_tokens", "temperature", "custom_params"})
"""The ``sampling_params`` keys :func:`generate` takes as its own arguments, not in ``sampling``."""


def generate(
    url: str,
    prompt: Sequence[int] | str,
    max_new_tokens: int,
    /,
    *,
    temperature: float | None = 0,
    sampling: Mapping[str, Any] | None = None,
    custom_params: Mapping[str, Any] | None = None,
    timeout: float = 600.0,
    **fields: Any,
) -> dict[str, Any]:
    """POST one non-streamed ``/generate`` to the server at ``url`` and return its decoded JSON
    answer (``text``, ``output_ids``, ``meta_info``, ...), read within ``timeout`` seconds.

    The request body, keys in this order: ``input_ids`` (``prompt`` as a list) or, when
    ``prompt`` is a str, ``text``; ``sampling_params``: ``max_new_tokens``, ``temperature``
    (0: greedy; None leaves it out, the server's default), ``sampling``'s items (further
    sampling parameters, e.g. ``ignore_eos``; none of :data:`SAMPLING_ARGUMENTS`, else
    ValueError) and ``custom_params`` unless None; then ``fields`` as top-level fields (e.g.
    ``return_logprob``, ``top_logprobs_num``, ``cache_salt``, ``extra_key``,
    ``routed_dp_rank``), each left out when its value is None. An error status raises
    ``urllib.error.HTTPError`` (:func:`semblend_sglang.server.http_json`)."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if temperature is not None:
        params["temperature"] = temperature
    if sampling is not None:
        taken = SAMPLING_ARGUMENTS.intersection(sampling)
        if taken:
            raise ValueError(f"pass {sorted(taken)} as generate's own arguments, not in sampling")
        params.update(sampling)
    if custom_params is not None:
        params["custom_params"] = dict(custom_params)
    payload: dict[str, Any] = (
        {"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}
    )
    payload["sampling_params"] = params
    payload.update({key: value for key, value in fields.items() if value is not None})
    answer: dict[str, Any] = http_json(url + "/generate", payload, timeout=timeout)
    return answer


def semblend_totals(url: str) -> dict[str, Any]:
    """semblend's counters summed over the schedulers of the server at ``url``
    (:func:`semblend_sglang.bench.client.semblend_snapshot`: ``GET /semblend/snapshot``'s
    ``total``); AssertionError when the server has no such route (a vanilla server), and
    ``httpx.HTTPStatusError`` on another error status."""
    total = semblend_snapshot(url)
    assert total is not None, f"{url} has no /semblend/snapshot route"
    return total


def semblend_metrics(url: str) -> dict[str, float]:
    """semblend's series on the server's ``/metrics`` (Prometheus text, ``--enable-metrics``),
    summed over schedulers (the ``pid`` label dropped); names keep their other labels. The
    lookup-time histogram is left out."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("semblend_") and not line.startswith("semblend_lookup_seconds"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?pid="\d+"', "", name).replace("{}", "")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def copied_tokens(metrics: dict[str, float]) -> float:
    """Tokens copied from donors in :func:`semblend_metrics`: kept, or recomputed by the
    recompute budget."""
    return metrics.get("semblend_reused_tokens_total", 0.0) + metrics.get(
        "semblend_recomputed_tokens_total", 0.0
    )


def outcome_count(metrics: dict[str, float], outcome: str) -> float:
    """Requests with ``outcome`` (exact, materialized, ...) in :func:`semblend_metrics`."""
    return metrics.get(f'semblend_requests_total{{outcome="{outcome}"}}', 0.0)
