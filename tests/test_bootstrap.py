"""The bootstrap is idempotent: with nothing changed, a second run installs nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _site_packages_state(prefix: Path) -> dict[str, int]:
    (site,) = (prefix / "lib").glob("python3*/site-packages")
    return {p.name: p.stat().st_mtime_ns for p in site.iterdir() if p.name.endswith(".dist-info")}


def assert_second_bootstrap_installs_nothing(target: str, variable: str, stamp: str) -> None:
    """``make <target> <variable>=<this venv>`` reports up to date and changes no package.
    Also used by tests/legacy for ``venv-legacy``."""
    prefix = Path(sys.prefix)
    assert (prefix / stamp).is_file(), f"{prefix} was not created by `make {target}`"
    before = _site_packages_state(prefix)
    result = subprocess.run(
        ["make", "-s", target, f"{variable}={prefix}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "is up to date; nothing to install" in result.stdout
    assert "installing" not in result.stdout
    assert _site_packages_state(prefix) == before


def test_second_make_venv_installs_nothing() -> None:
    assert_second_bootstrap_installs_nothing("venv", "VENV", ".semblend-bootstrap")
