"""The time-budget plugin of ``make test`` (tests/time_budget.py), run on a small suite."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO_ROOT
from tests.time_budget import BUDGETS_S, DEFAULT_BUDGET_S, budget_s, by_file, slowest

pytest_plugins = ["pytester"]


def test_slowest_sorts_longest_first_and_keeps_n() -> None:
    times = {"a": 1.0, "b": 3.0, "c": 2.0}
    assert slowest(times, 2) == [("b", 3.0), ("c", 2.0)]


def test_by_file_sums_each_files_tests_longest_first() -> None:
    times = {"t/a.py::x": 1.0, "t/b.py::y[1]": 2.5, "t/a.py::z": 2.0, "t/c.py::w": 0.5}
    assert by_file(times, 2) == [("t/a.py", 3.0, 2), ("t/b.py", 2.5, 1)]


def test_budget_is_per_cpu_kind_and_the_largest_elsewhere() -> None:
    for cpu, budget in BUDGETS_S.items():
        assert budget_s(cpu) == budget <= DEFAULT_BUDGET_S
    assert budget_s("AMD EPYC 7B13") == DEFAULT_BUDGET_S


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A suite of two tests, one of them 0.3 s, under a budget of 0.1 s."""
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    pytester.makeconftest("import tests.time_budget as budget\nbudget.BUDGET_S = 0.1\n")
    pytester.makepyfile(
        "import time\n\ndef test_slow():\n    time.sleep(0.3)\n\ndef test_fast():\n    pass\n"
    )
    return pytester


def test_a_suite_over_budget_fails_only_when_asked(suite: pytest.Pytester) -> None:
    asked = suite.runpytest_subprocess("-p", "tests.time_budget", "--slowest-budget")
    assert asked.ret == pytest.ExitCode.TESTS_FAILED
    asked.stdout.fnmatch_lines(
        [
            "*2 slowest tests*",
            "*test_slow*",
            "*1 slowest test files*",
            "*2 tests*test_a_suite*.py",
            "*every test of the run (2 tests)",
            "*FAILED time budget*",
        ]
    )
    plain = suite.runpytest_subprocess("-p", "tests.time_budget")
    assert plain.ret == pytest.ExitCode.OK
    plain.stdout.fnmatch_lines(["*in all (budget 0 s*"])


def test_the_real_server_starts_are_counted_per_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin counts each call of ``semblend_sglang.server.start_server`` against the test
    running it. Here ``start_server`` is a recorder standing in for the real start (the count,
    not the server, is under test)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    pytester.makeconftest(
        "from semblend_sglang import server\n"
        "server.start_server = lambda *args, **kwargs: None  # stand-in: no real start\n"
    )
    pytester.makepyfile(
        "from semblend_sglang import server\n\n"
        "def test_two_starts():\n    server.start_server('m')\n    server.start_server('m')\n\n"
        "def test_none():\n    pass\n"
    )
    result = pytester.runpytest_subprocess("-p", "tests.time_budget")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "*2 real server starts in this process*",
            "   2  test_the_real_server_starts*::test_two_starts",
        ]
    )
    counted = [line for line in result.outlines if re.fullmatch(r"\s*\d+  \S+::test_\w+", line)]
    assert len(counted) == 1  # the test that started none is not listed
