"""Replacing sglang methods with wrappers, and putting the originals back.

:func:`install_wrappers` and :func:`restore` are what every hook installer here uses (the
version adapters, the attention hooks); nothing here imports sglang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

Wrappers = Mapping[tuple[type | ModuleType, str], Callable[..., Any]]
"""Wrappers by (owner class or module, attribute name)."""
Originals = dict[tuple[type | ModuleType, str], Any]
"""What :func:`restore` puts back, by (owner class or module, attribute name)."""

_INHERITED = object()
"""Marks a replaced method that the class inherited (restored by deleting the wrapper)."""


def install_wrappers(wrappers: Wrappers) -> Originals:
    """Set each ``(owner, name)`` attribute to its wrapper; return what :func:`restore` needs.

    Each wrapper (a function, or a ``classmethod`` of one) gets ``__wrapped__`` (the method it
    replaces, inherited ones included) and that method's docstring. Adapters call this from
    ``apply``; it does not check idempotence.
    """
    originals: Originals = {}
    for (owner, name), wrapper in wrappers.items():
        own = owner.__dict__.get(name, _INHERITED)
        replaced = getattr(owner, name)
        function = wrapper.__func__ if isinstance(wrapper, classmethod) else wrapper
        function.__wrapped__ = replaced  # type: ignore[attr-defined]
        function.__doc__ = getattr(replaced, "__doc__", None)
        originals[(owner, name)] = own
        setattr(owner, name, wrapper)
    return originals


def restore(originals: Originals) -> None:
    """Undo :func:`install_wrappers`: put back each class's own method, or delete the wrapper
    of an inherited one. Adapters call this from ``remove``."""
    for (owner, name), original in originals.items():
        if original is _INHERITED:
            if name in owner.__dict__:
                delattr(owner, name)
        else:
            setattr(owner, name, original)
