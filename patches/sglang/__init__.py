"""SGLang integration: ``patch_radix_cache()`` / ``unpatch_radix_cache()`` and the plugin.

Importing this package imports no sglang module; sglang is touched only when a patch is applied.
The patch is chosen by the installed sglang version (see :mod:`.adapter`); on a version no adapter
serves, one clear warning is logged and sglang is left untouched.

SGLang starts its schedulers with the ``spawn`` method, so a patch applied in the launching
process does not reach them: :func:`load_plugin` is registered as a ``sglang.srt.plugins`` entry
point, which every sglang process runs, and applies the patch there when ``SEMBLEND_ENABLED=1``.
"""

from __future__ import annotations

import logging
import os
import threading

from packaging.version import Version

from semblend_sglang.config import Config, ConfigError
from semblend_sglang.config_fields import parse_flag

from .engine.adapter import SglangAdapter, installed_sglang_version

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_installed: SglangAdapter | None = None


def _adapters() -> list[type[SglangAdapter]]:
    from .engine.legacy import LegacyRadixCacheAdapter
    from .engine.unified import UnifiedRadixCacheAdapter

    return [UnifiedRadixCacheAdapter, LegacyRadixCacheAdapter]


def adapter_class_for(version: Version | None) -> type[SglangAdapter] | None:
    """The adapter class that serves sglang ``version`` (None: no adapter, or no version)."""
    if version is None:
        return None
    return next((cls for cls in _adapters() if cls.supports(version)), None)


def supported_versions() -> str:
    """The sglang versions some adapter serves, as each adapter declares them (``supported``)."""
    return "; ".join(f"{cls.supported} ({cls.name})" for cls in _adapters())


def unserved_version_reason(version: Version | None) -> str:
    """Why no adapter serves sglang ``version`` (a start-up warning and the snapshot's
    ``reuse_off`` say this)."""
    return (
        f"sglang {version} is not supported by this version of semblend-sglang "
        f"(supported: {supported_versions()}); SGLang is left unpatched"
    )


def patch_radix_cache(config: Config | None = None) -> SglangAdapter | None:
    """Install semblend's hooks into the installed sglang; idempotent.

    ``config`` defaults to ``Config.from_env()``. Returns the installed adapter, or None (after one
    warning) when no adapter supports the installed sglang version. It patches this process
    only, for code that builds SGLang's scheduler here; ``sglang.Engine`` and servers spawn
    their schedulers, which get it through the plugin (``SEMBLEND_ENABLED=1``).
    """
    global _installed
    with _lock:
        if _installed is not None and _installed.is_applied():
            return _installed
        version = installed_sglang_version()
        adapter_cls = adapter_class_for(version)
        if adapter_cls is None:
            logger.warning("semblend: %s", unserved_version_reason(version))
            return None
        adapter = adapter_cls(config or Config.from_env())  # type: ignore[call-arg]
        adapter.apply()
        _installed = adapter
        logger.info("semblend: %s hooks installed (sglang %s)", adapter.name, version)
        return adapter


def unpatch_radix_cache() -> None:
    """Restore every sglang method the patch replaced; idempotent."""
    global _installed
    with _lock:
        if _installed is not None:
            _installed.remove()
        _installed = None


def installed_adapter() -> SglangAdapter | None:
    """The adapter currently installed in this process, or None."""
    return _installed


def load_plugin() -> None:
    """``sglang.srt.plugins`` entry point: patch when ``SEMBLEND_ENABLED=1``; never raises.

    In the HTTP server's process it also adds ``GET /semblend/snapshot`` (.http_routes); in the
    data-parallel controller's, donor-aware dispatch (.dp_dispatch).
    A bad ``SEMBLEND_*`` setting is fatal, as under the launcher: it raises ``SystemExit``
    naming the key (SGLang's plugin loader catches ``Exception`` only), so the server does not
    start with a configuration it would ignore. Any other failure is logged and leaves SGLang
    unpatched.
    Whatever ``SEMBLEND_ENABLED`` says, it first guards SGLang against prompts that would crash
    its scheduler (``.request_guard``; off with ``SEMBLEND_REQUEST_GUARD=0``) and, on a CPU
    runtime, makes torch_native's extend query-only
    (``.backends.install_cpu_query_only_extend``; off with ``SEMBLEND_CPU_QUERY_ONLY_EXTEND=0``).
    """
    try:
        from .engine.request_guard import install_request_guard

        install_request_guard()
    except Exception as exc:
        logger.error("semblend: request guard not installed (%s: %s)", type(exc).__name__, exc)
    try:
        from .attention.backends import install_cpu_query_only_extend

        install_cpu_query_only_extend()
    except Exception as exc:
        logger.error(
            "semblend: CPU query-only extend not installed (%s: %s)", type(exc).__name__, exc
        )
    if not parse_flag(os.environ.get("SEMBLEND_ENABLED")):
        return
    try:
        config = Config.from_env()
    except ConfigError as exc:
        logger.error("semblend: bad configuration: %s", exc)
        raise SystemExit(f"semblend: bad configuration: {exc}") from exc
    try:
        from .engine.http_routes import install_snapshot_route_on_import

        if patch_radix_cache(config) is not None:
            install_snapshot_route_on_import()
        else:  # no adapter for this sglang: the route says why
            install_snapshot_route_on_import(unserved_version_reason(installed_sglang_version()))
    except Exception as exc:
        logger.error("semblend: not installed (%s: %s)", type(exc).__name__, exc)
    _install_dp_dispatch_here()


def _install_dp_dispatch_here() -> None:
    """Donor-aware data-parallel dispatch (.dp_dispatch), in the process that holds SGLang's
    DataParallelController module (the controller runs the plugins after importing it)."""
    import sys

    from .engine.dp_dispatch import CONTROLLER_MODULE, install_dp_dispatch

    if CONTROLLER_MODULE not in sys.modules:
        return
    try:
        install_dp_dispatch()
    except Exception as exc:
        logger.error("semblend: dispatch not installed (%s: %s)", type(exc).__name__, exc)
