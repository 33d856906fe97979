"""Logging an error of the semantic path once per place and exception type."""

from __future__ import annotations

import logging
import threading


class OnceLog:
    """Logs a failure once per (``where``, exception type) on ``logger``; thread-safe. Used by
    the provider and the SGLang runtime, whose callers then fall back to the normal path."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()

    def log(self, where: str, exc: BaseException) -> bool:
        """Warn about ``exc`` at ``where`` (with its traceback) unless that place and exception
        type were logged before; True when this call logged."""
        key = (where, type(exc).__name__)
        with self._lock:
            if key in self._logged:
                return False
            self._logged.add(key)
        self._logger.warning(
            "semblend %s failed (%s: %s); the request falls back to a normal prefill",
            where,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        return True
