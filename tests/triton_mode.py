"""Which mode this process's Triton runs kernels in: compiled, or under its interpreter."""

from __future__ import annotations


def triton_interpreted() -> bool:
    """True when this process imported triton under ``TRITON_INTERPRET=1``, so its kernels run in
    the interpreter; False when they are compiled. ``triton.jit`` reads the flag when it is
    applied, triton.language's own helpers included, so the flag's value now says nothing: the
    test is whether ``triton.language.standard.zeros`` is an ``InterpretedFunction``. Imports
    triton (ImportError without it)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros, InterpretedFunction)


def run_interpreted(test_file: str, at_least: int, timeout: int = 900) -> None:
    """Run the pytest module ``test_file`` in a child process started with ``TRITON_INTERPRET=1``
    and assert that it passes, with at least ``at_least`` tests passed (a module whose
    interpreter-only tests all skipped would pass with none). Called by that module's own runner
    test, which must skip in the child (:func:`triton_interpreted`)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    passed = re.search(r"(\d+) passed", child.stdout)
    assert passed is not None and int(passed.group(1)) >= at_least, child.stdout[-2000:]
