"""What the bench jobs report beside their measurements, and how: the machine and software
(:func:`cpu_model`, :func:`environment`) and JSON files (:func:`write_json`).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PACKAGES = ("semblend-sglang", "sglang", "torch", "transformers")
"""Distributions whose versions :func:`environment` records."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), else what
    :mod:`platform` knows (processor, else machine type)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution in ``names`` (None when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def environment(**extra: Any) -> dict[str, Any]:
    """The machine and software a measurement ran on, for a JSON report: UTC ``date``,
    ``python``, ``platform``, ``cpu`` (:func:`cpu_model`), ``cpu_count``, ``versions``
    (:data:`PACKAGES`), then ``extra`` (a job's model, flags, ...)."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "versions": package_versions(),
        **extra,
    }


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (one trailing newline) to ``path``, creating its folder;
    returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
