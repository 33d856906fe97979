"""Logging an error of the semantic path once per place and exception type."""

from __future__ import annotations

import logging
import threading

NORMAL_PREFILL = "the request falls back to a normal prefill"


class OnceLog:
    """Logs a failure once per (``where``, exception type) on ``logger``; thread-safe. Used by
    every fail-open seam (provider, SGLang runtime, DP dispatch, vLLM connector); ``consequence``
    names what the caller does instead, and the caller does it: this class only logs."""

    def __init__(self, logger: logging.Logger, consequence: str = NORMAL_PREFILL) -> None:
        self._logger = logger
        self._consequence = consequence
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
            "semblend %s failed (%s: %s); %s",
            where,
            type(exc).__name__,
            exc,
            self._consequence,
            exc_info=exc,
        )
        return True
