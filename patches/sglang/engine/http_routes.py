"""``GET /semblend/snapshot``: the schedulers' outcome counters as JSON, on SGLang's HTTP server.

The counters live in the scheduler processes. The unified adapter adds them to the scheduler's
internal state (the same path ``GET /server_info`` reads, key ``"semblend"``); this route asks
every data-parallel scheduler for that state through SGLang's tokenizer manager and returns
``{"ranks": [snapshot or null, ...], "total": summed counters, "reuse_off": every start-up
reason a scheduler gave why it will not reuse KV, "config": the first scheduler's resolved
settings}``; where the plugin cannot patch the installed sglang, ``reuse_off`` says so and no
scheduler is asked. It works with or without
``--enable-metrics``. The plugin calls :func:`install_snapshot_route_on_import` in every sglang
process; the route is added when (and if) SGLang's HTTP server module is imported there, which
``sglang.launch_server`` does after running the plugins. Nothing here raises.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ..after_import import call_after_import

logger = logging.getLogger(__name__)

SNAPSHOT_PATH = "/semblend/snapshot"
"""Route of the JSON snapshot on the SGLang HTTP server."""

STATE_KEY = "semblend"
"""Key of the snapshot inside each scheduler's internal state (``/server_info``)."""

CONFIG_KEY = "semblend_config"
"""Key of the scheduler's resolved Config (``Config.as_dict()``) inside its internal state."""

_HTTP_MODULE = "sglang.srt.entrypoints.http_server"


def merge_snapshots(snapshots: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Sum the counters of several schedulers' snapshots (None entries are skipped).

    Numeric fields and per-label dicts (nested too: ``by_settings``) are summed;
    ``lookup_ms_mean`` is the lookup-weighted mean.
    """
    total: dict[str, Any] = {}
    weighted_ms = 0.0
    for snap in snapshots:
        if not snap:
            continue
        _add_counts(total, snap)
        weighted_ms += float(snap.get("lookup_ms_mean", 0.0)) * int(snap.get("lookups", 0))
    if total:
        total["lookup_ms_mean"] = weighted_ms / total["lookups"] if total.get("lookups") else 0.0
    return total


def _add_counts(total: dict[str, Any], counts: dict[str, Any]) -> None:
    """Add the numbers of ``counts`` into ``total``, key by key, dicts recursively."""
    for key, value in counts.items():
        if isinstance(value, dict):
            _add_counts(total.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


def unserved_snapshot(reason: str) -> dict[str, Any]:
    """The route's answer where semblend is installed but cannot patch this sglang: no
    scheduler reports, and ``reuse_off`` says why."""
    return {"ranks": [], "total": {}, "config": None, "reuse_off": [reason]}


def reuse_off_of(ranks: list[dict[str, Any] | None]) -> list[str]:
    """Every start-up reason any scheduler gave why it will not reuse KV (``reuse_off`` of its
    snapshot), each once, in rank order."""
    out: list[str] = []
    for snap in ranks:
        for reason in (snap or {}).get("reuse_off", ()):
            if reason not in out:
                out.append(reason)
    return out


def install_snapshot_route(unserved: str | None = None) -> bool:
    """Add ``GET /semblend/snapshot`` to SGLang's FastAPI app when this process serves it.

    With ``unserved`` (the plugin could not patch this sglang: why) the route answers
    :func:`unserved_snapshot` and asks no scheduler. Returns True when the route is (already)
    installed, False when this process has no SGLang HTTP server (schedulers, in-process
    engines) or the app cannot take the route.
    """
    module = sys.modules.get(_HTTP_MODULE)
    app = getattr(module, "app", None)
    if module is None or app is None:
        return False
    try:
        if any(getattr(route, "path", None) == SNAPSHOT_PATH for route in app.router.routes):
            return True

        async def semblend_snapshot() -> dict[str, Any]:
            """Outcome counters of every scheduler (see patches/sglang/engine/http_routes.py)."""
            if unserved is not None:
                return unserved_snapshot(unserved)
            states = await module._global_state.tokenizer_manager.get_internal_state()
            ranks = [state.get(STATE_KEY) for state in states]
            configs = [state.get(CONFIG_KEY) for state in states if state.get(CONFIG_KEY)]
            return {
                "ranks": ranks,
                "total": merge_snapshots(ranks),
                "reuse_off": reuse_off_of(ranks),
                "config": configs[0] if configs else None,
            }

        _admin_optional(semblend_snapshot)
        app.add_api_route(SNAPSHOT_PATH, semblend_snapshot, methods=["GET"])
        return True
    except Exception as exc:
        logger.warning(
            "semblend: %s not installed (%s: %s)", SNAPSHOT_PATH, type(exc).__name__, exc
        )
        return False


def _admin_optional(endpoint: Any) -> None:
    """Mark ``endpoint`` with SGLang's ``ADMIN_OPTIONAL`` auth level (as ``/flush_cache``): open
    when the server has no key, else it needs ``--admin-api-key`` (or ``--api-key`` when only
    that is set). On an sglang without per-endpoint auth levels the server's own rule applies."""
    try:
        from sglang.srt.utils.auth import AuthLevel, auth_level
    except ImportError:
        return
    auth_level(AuthLevel.ADMIN_OPTIONAL)(endpoint)


def install_snapshot_route_on_import(unserved: str | None = None) -> None:
    """Add the route (:func:`install_snapshot_route` with ``unserved``) now if SGLang's HTTP
    server module is loaded, else as soon as it is imported.

    Idempotent; imports nothing itself. Called by the plugin in every sglang process.
    """
    call_after_import(_HTTP_MODULE, lambda _module: install_snapshot_route(unserved))
