"""The README's request example ("a request that hits"), run as written with bash against the
session's shared semblend server (tests/conftest.py ``semblend_server``): its second request is
a semantic hit that the snapshot counts, and ``cached_tokens`` shows SGLang's exact prefix only."""

from __future__ import annotations

import re
import subprocess

import pytest

from semblend_sglang.server import SglangServer
from tests.conftest import REPO_ROOT
from tests.harness.server import semblend_totals

pytestmark = pytest.mark.e2e

EXAMPLE_URL = "http://127.0.0.1:30000"
"""The URL the README's example names (``make serve``'s)."""


def readme_example() -> str:
    """The bash block between the README's example markers."""
    text = (REPO_ROOT / "README.md").read_text()
    found = re.search(
        r"<!-- example: a request that hits[^>]*-->\s*```bash\n(.*?)```\s*<!-- end of example -->",
        text,
        re.S,
    )
    assert found is not None, "README.md has no 'a request that hits' example block"
    return found.group(1)


def test_the_readme_example_names_make_serves_url() -> None:
    assert EXAMPLE_URL in readme_example()


def test_the_readme_example_is_a_semantic_hit(semblend_server: SglangServer) -> None:
    url = semblend_server.url
    script = readme_example().replace(EXAMPLE_URL, url)
    before = semblend_totals(url)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    after = semblend_totals(url)
    donor, target, snapshot = done.stdout.splitlines()
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    assert after["reused_tokens"] - before["reused_tokens"] >= 300
    assert snapshot == (
        f"materialized {after['outcomes']['materialized']} reused_tokens {after['reused_tokens']}"
    )
    for line in (donor, target):
        words = line.split()
        assert words[0::2] == ["prompt_tokens", "cached_tokens"], line
        assert int(words[1]) > 600 and int(words[3]) < 16, line  # no exact prefix to speak of
