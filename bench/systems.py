"""The systems the bench compares, the environment of each one's SGLang server, starting them,
and the options that name them (``--systems``, ``--url``, ``--semblend-env``).

Systems: ``vanilla`` (SEMBLEND_ENABLED=0), ``exact_spans`` and ``substitute`` (semblend in that
mode) and, chosen with ``--systems`` only, ``exact_spans_sglang_dispatch``: exact_spans with
donor-aware data-parallel dispatch off (SEMBLEND_DISPATCH_ENABLED=0), so that with
``--server-arg=--dp-size --server-arg=N`` SGLang's own ``--load-balance-method`` places every
request; and ``reorder``, the lossless anchor: vanilla SGLang sent each probe of passages with
its passages reordered so that a donor's order is an exact prefix (``BenchRequest.
reordered_ids``; probes without passages are not sent to it); and ``reorder_spans``, semblend
(exact_spans, default settings) sent each such probe as it is with its passages declared
(``custom_params.semblend_passages``, ``BenchRequest.passage_bounds``): the server chooses the
order (docs/sglang.md, "Passage order"), SGLang's exact cache serves the leading run and
semantic reuse the rest. Started servers with
``--dp-size N`` on CPU get ``SGLANG_CPU_OMP_THREADS_BIND`` (one core per rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

SGLANG_DISPATCH = "exact_spans_sglang_dispatch"
REORDER = "reorder"
REORDER_SPANS = "reorder_spans"
SYSTEMS = ("vanilla", "exact_spans", "substitute", SGLANG_DISPATCH, REORDER, REORDER_SPANS)
DEFAULT_SYSTEMS = ("vanilla", "exact_spans", "substitute")
"""Without ``--systems``: SGLANG_DISPATCH differs from exact_spans only with ``--dp-size``, and
REORDER and REORDER_SPANS run on the workloads of passages only (a server each)."""
SEMBLEND_SYSTEMS = ("exact_spans", "substitute", SGLANG_DISPATCH)
"""The semblend systems sent every probe as it is (:meth:`.e2e_runner.Runner.run_group`)."""
SEMBLEND_SERVERS = (*SEMBLEND_SYSTEMS, REORDER_SPANS)
"""Every system whose server runs semblend (its snapshot is read, ``--semblend-env`` applies)."""
QUICK_SYSTEMS = ("vanilla", "exact_spans")
"""``--quick`` leaves out the opt-in, output-changing substitute mode (one server fewer)."""
SERVER_ENV: dict[str, dict[str, str]] = {
    "vanilla": {"SEMBLEND_ENABLED": "0"},
    REORDER: {"SEMBLEND_ENABLED": "0"},
    "exact_spans": {"SEMBLEND_ENABLED": "1", "SEMBLEND_MODE": "exact_spans"},
    "substitute": {
        "SEMBLEND_ENABLED": "1",
        "SEMBLEND_MODE": "substitute",
        "SEMBLEND_EXACT_MATERIALIZATION_ONLY": "0",
    },
    SGLANG_DISPATCH: {
        "SEMBLEND_ENABLED": "1",
        "SEMBLEND_MODE": "exact_spans",
        "SEMBLEND_DISPATCH_ENABLED": "0",
    },
    REORDER_SPANS: {"SEMBLEND_ENABLED": "1", "SEMBLEND_MODE": "exact_spans"},
}
"""Environment of each system's server (the rest of the SemBlend settings are defaults)."""
SYSTEM_OWNED_ENV = ("SEMBLEND_ENABLED", "SEMBLEND_MODE", "SEMBLEND_DISCOVERY_ONLY")
"""Variables each system sets itself (--semblend-env may not override them)."""


def system_environ(
    system: str, extra: Sequence[str], semblend_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables a started server of ``system`` gets on top of the server environment: the
    data-parallel CPU binding ``extra`` (its sglang flags) needs, then ``semblend_env``
    (``--semblend-env``) when ``system`` is a semblend system, then the system's own
    :data:`SERVER_ENV`, which wins."""
    from ..server import cpu_dp_environ

    env = cpu_dp_environ(extra)
    if system in SEMBLEND_SERVERS:
        env.update(semblend_env or {})
    env.update(SERVER_ENV[system])
    return env


def start_servers(
    systems: Sequence[str],
    model: str,
    extra: Sequence[str],
    logs: Path,
    semblend_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Start one SGLang server per system (start-ups overlap), each with ``extra`` flags and
    :func:`system_environ` (``semblend_env`` on semblend systems only); wait until all are
    healthy. Returns system -> ``SglangServer``; on any failure every started server is stopped
    and the error re-raised. Logs go to ``logs/e2e-{system}-server.log``."""
    started = _start_healthy(
        [(system, f"e2e-{system}") for system in systems], model, extra, logs, semblend_env
    )
    return dict(zip(systems, started, strict=True))


def start_servers_of(
    system: str, count: int, model: str, extra: Sequence[str], logs: Path
) -> list[Any]:
    """Start ``count`` servers of one ``system`` (start-ups overlap) and wait until all are
    healthy, as :func:`start_servers` does. Logs go to ``logs/{system}-{i}-server.log``."""
    return _start_healthy([(system, f"{system}-{i}") for i in range(count)], model, extra, logs)


def _start_healthy(
    named: Sequence[tuple[str, str]],
    model: str,
    extra: Sequence[str],
    logs: Path,
    semblend_env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Start a server per (system, log name) and return them healthy
    (:func:`semblend_sglang.server.start_healthy`: on a failure every one is stopped)."""
    from ..server import ServerSpec, start_healthy

    specs = [
        ServerSpec(
            model,
            extra_args=list(extra),
            env=system_environ(system, extra, semblend_env),
            log_path=logs / f"{name}-server.log",
        )
        for system, name in named
    ]
    return start_healthy(specs, timeout=900)


def parse_systems(value: str) -> list[str]:
    """``--systems``: comma-separated names of :data:`SYSTEMS`, in the order given;
    ``click.BadParameter`` naming the unknown ones."""
    chosen = [s.strip() for s in value.split(",") if s.strip()]
    bad = [s for s in chosen if s not in SYSTEMS]
    if bad:
        raise click.BadParameter(f"unknown system(s) {bad}", param_hint="'--systems'")
    return chosen


def parse_semblend_env(values: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs for the started semblend servers; each KEY must be a SemBlend setting
    (config.FIELDS) other than those in SYSTEM_OWNED_ENV, each VALUE valid for it;
    ``click.BadParameter`` otherwise."""
    from ..config import FIELDS_BY_ENV, ConfigError, parse_value

    out: dict[str, str] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        spec = FIELDS_BY_ENV.get(key)
        if not sep or spec is None or key in SYSTEM_OWNED_ENV:
            raise click.BadParameter(
                f"{value!r}: expected KEY=VALUE with KEY a SEMBLEND_* setting other than "
                f"{', '.join(SYSTEM_OWNED_ENV)}",
                param_hint="'--semblend-env'",
            )
        try:
            parse_value(spec, raw, key)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="'--semblend-env'") from None
        out[key] = raw
    return out


def parse_urls(values: Sequence[str]) -> dict[str, str]:
    """``--url SYSTEM=URL`` values as system -> URL; ``click.BadParameter`` when SYSTEM is not
    one of :data:`SYSTEMS` or URL does not start with ``http``."""
    out: dict[str, str] = {}
    for value in values:
        system, sep, url = value.partition("=")
        if not sep or system not in SYSTEMS or not url.startswith("http"):
            raise click.BadParameter(
                f"{value!r}: expected SYSTEM=URL with SYSTEM one of {', '.join(SYSTEMS)}",
                param_hint="'--url'",
            )
        out[system] = url
    return out


@dataclass(frozen=True)
class ServerPlan:
    """The systems one bench run measures (``systems``, in order), the running servers
    ``--url`` named for some of them (``urls``: system -> URL) and the rest, which the bench
    starts (``to_start``)."""

    systems: list[str]
    urls: dict[str, str]
    to_start: list[str]


def plan_servers(
    systems: str | None,
    default: Sequence[str],
    urls: Mapping[str, str],
    semblend_env: Mapping[str, str],
) -> ServerPlan:
    """Which systems run where: ``systems`` (``--systems``; None: the URL-named systems, in
    ``--url`` order, or else ``default``); a system ``urls`` names is measured there, every
    other one is started. ``click.BadParameter`` when ``--url`` names a system outside
    ``--systems``, or when ``semblend_env`` is given and a semblend server is named by URL (it
    applies to started servers only)."""
    chosen = parse_systems(systems) if systems is not None else list(urls or default)
    stray = [s for s in urls if s not in chosen]
    if stray:
        raise click.BadParameter(
            f"names {', '.join(stray)}, not among --systems {','.join(chosen)}",
            param_hint="'--url'",
        )
    running = [s for s in urls if s in SEMBLEND_SERVERS]
    if semblend_env and running:
        raise click.BadParameter(
            f"applies to started servers only, and --url names {', '.join(running)}: set it "
            "on your servers",
            param_hint="'--semblend-env'",
        )
    return ServerPlan(chosen, dict(urls), [s for s in chosen if s not in urls])
