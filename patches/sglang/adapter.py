"""The one interface between semblend and a family of SGLang versions.

``patch_radix_cache()`` picks the adapter whose :meth:`SglangAdapter.supports` accepts the installed
sglang version and calls :meth:`~SglangAdapter.apply`. Everything version-specific lives in the
adapter's module; nothing outside ``semblend_sglang.patches.sglang`` touches sglang internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


class SglangAdapter(ABC):
    """Installs and removes semblend's hooks for one family of SGLang versions.

    ``apply`` must be idempotent and leave every original method recoverable; ``remove`` restores
    exactly what ``apply`` replaced. Neither may raise for a supported version.
    ``supported`` is the one declaration of the sglang versions the adapter serves.
    """

    name: str = "abstract"
    supported: ClassVar[SpecifierSet] = SpecifierSet("<0")
    """The sglang versions this adapter serves (pre-releases of them included)."""

    @classmethod
    def supports(cls, version: Version) -> bool:
        """True when this adapter serves sglang ``version`` (it is in :attr:`supported`)."""
        return cls.supported.contains(version, prereleases=True)

    @abstractmethod
    def apply(self) -> None:
        """Install the hooks (idempotent)."""

    @abstractmethod
    def remove(self) -> None:
        """Restore every method ``apply`` replaced (idempotent)."""

    @abstractmethod
    def is_applied(self) -> bool:
        """True while the hooks are installed."""


def installed_sglang_version() -> Version | None:
    """The installed sglang's version, or None when sglang is absent or its version unparsable."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return Version(version("sglang"))
    except (PackageNotFoundError, InvalidVersion):
        return None


_INHERITED = object()
"""Marks a replaced method that the class inherited (restored by deleting the wrapper)."""

Wrappers = Mapping[tuple[type, str], Callable[..., Any]]
Originals = dict[tuple[type, str], Any]


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
