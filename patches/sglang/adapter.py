"""The one interface between semblend and a family of SGLang versions.

``patch_radix_cache()`` picks the adapter whose :meth:`SglangAdapter.supports` accepts the installed
sglang version and calls :meth:`~SglangAdapter.apply`. Everything version-specific lives in the
adapter's module; nothing outside ``semblend_sglang.patches.sglang`` touches sglang internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from packaging.version import InvalidVersion, Version


class SglangAdapter(ABC):
    """Installs and removes semblend's hooks for one family of SGLang versions.

    ``apply`` must be idempotent and leave every original method recoverable; ``remove`` restores
    exactly what ``apply`` replaced. Neither may raise for a supported version.
    """

    name: str = "abstract"

    @classmethod
    @abstractmethod
    def supports(cls, version: Version) -> bool:
        """True when this adapter serves sglang ``version``."""

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
