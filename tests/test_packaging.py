"""The built wheel installs `patches/` and `kernels/` only as semblend_sglang subpackages."""

from __future__ import annotations

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
