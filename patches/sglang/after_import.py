"""Run a hook right after an sglang module executes, whether it is imported yet or not.

The plugin runs early in every sglang process, often before the module it changes is imported
(SGLang's HTTP server, its tokenizer manager). :func:`call_after_import` runs the hook now when
the module is loaded, else installs a one-shot meta-path finder that runs it as soon as the
module's code has executed. Used by the plugin's installers (.http_routes, .request_guard);
imports no sglang module itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_lock = threading.RLock()


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder for one module that runs its hooks right after the module executes."""

    def __init__(self, fullname: str) -> None:
        self.fullname = fullname
        self.hooks: list[Callable[[ModuleType], None]] = []
        self._inner: importlib.abc.Loader | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> ModuleType | None:
        assert self._inner is not None
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self._inner is not None
        self._inner.exec_module(module)
        for hook in self.hooks:
            hook(module)


def call_after_import(fullname: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` now if ``fullname`` is imported, else right after its first import.

    The hook must not raise (an exception would fail the import of ``fullname``); each hook
    runs once per call. Thread-safe; imports nothing itself.
    """
    with _lock:
        module = sys.modules.get(fullname)
        if module is not None:
            hook(module)
            return
        finder = next(
            (f for f in sys.meta_path if isinstance(f, _AfterImport) and f.fullname == fullname),
            None,
        )
        if finder is None:
            finder = _AfterImport(fullname)
            sys.meta_path.insert(0, finder)
        finder.hooks.append(hook)
