"""pytest plugin: the slowest tests of a run, summed, against a declared budget.

``make test`` loads it (``-p tests.time_budget``) and passes ``--slowest-budget``: after the run
it prints the :data:`SLOWEST` slowest tests (setup, call and teardown together, so a
module-scoped server's start counts for the test that started it) and their total, then the
:data:`FILES` test files that took longest (where a whole run's time goes), and fails the
run when the slowest tests' total is over :data:`BUDGET_S`, the budget of this machine's CPU
kind. The budgets and the quiet measurements behind them are in docs/perf.md ("CI wall time");
raise one only together with that table, so that a suite that grows is seen when it grows.
Without the option it only prints. It also counts the real servers the run started in its own
process (:func:`semblend_sglang.server.start_server`, wrapped at configure time), per test that
started them: the server starts are most of the suite's time (docs/perf.md, "CI wall time").
Servers a test's subprocess starts (the bench commands) are not in that count.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest

from semblend_sglang.bench.report import cpu_model

SLOWEST = 20
FILES = 15

BUDGETS_S = {
    "Intel(R) Xeon(R) Processor": 2300.0,
    "Intel(R) Xeon(R) Processor @ 2.80GHz": 2120.0,
}
"""Seconds the :data:`SLOWEST` slowest tests may take together on a machine kind, keyed by its
CPU model name exactly as ``/proc/cpuinfo`` gives it: the total measured quietly on that kind
plus about a third (docs/perf.md, "CI wall time")."""

DEFAULT_BUDGET_S = 4025.0
"""The budget on any other CPU: the Xeon's times 1.75 (AMD EPYC, the slowest kind these machines
have been, ran the whole suite 1.75 times as long as the Xeon)."""


def budget_s(cpu: str) -> float:
    """The budget for a machine whose CPU model name is ``cpu``."""
    return BUDGETS_S.get(cpu, DEFAULT_BUDGET_S)


CPU = cpu_model()
BUDGET_S = budget_s(CPU)
"""Seconds the :data:`SLOWEST` slowest tests of ``make test`` may take together here."""

_durations: defaultdict[str, float] = defaultdict(float)
_over: list[str] = []
_starts: defaultdict[str, int] = defaultdict(int)
_current = {"test": "(outside a test)"}


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--slowest-budget``: fail the run when the slowest tests exceed :data:`BUDGET_S`."""
    parser.addoption(
        "--slowest-budget",
        action="store_true",
        help=f"fail when the {SLOWEST} slowest tests take more than {BUDGET_S:.0f} s together",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Wrap ``semblend_sglang.server.start_server`` to count each start against the running
    test (module- and session-scoped fixtures start in their first test's setup)."""
    from semblend_sglang import server

    real_start = server.start_server

    def counted_start(*args: Any, **kwargs: Any) -> Any:
        _starts[_current["test"]] += 1
        return real_start(*args, **kwargs)

    server.start_server = counted_start  # type: ignore[assignment]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, Any, Any]:
    """Name the running test for the start count."""
    _current["test"] = item.nodeid
    try:
        return (yield)
    finally:
        _current["test"] = "(outside a test)"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's duration to its test."""
    _durations[report.nodeid] += report.duration


def slowest(durations: dict[str, float], n: int = SLOWEST) -> list[tuple[str, float]]:
    """The ``n`` longest (test id, seconds), longest first."""
    return sorted(durations.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def by_file(durations: dict[str, float], n: int = FILES) -> list[tuple[str, float, int]]:
    """The ``n`` test files whose tests took longest together: (file, seconds, tests), longest
    first."""
    seconds: defaultdict[str, float] = defaultdict(float)
    tests: defaultdict[str, int] = defaultdict(int)
    for nodeid, s in durations.items():
        path = nodeid.split("::", 1)[0]
        seconds[path] += s
        tests[path] += 1
    order = sorted(seconds, key=lambda path: (-seconds[path], path))[:n]
    return [(path, seconds[path], tests[path]) for path in order]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when ``--slowest-budget`` is given and the total is over budget."""
    total = sum(s for _, s in slowest(_durations))
    if session.config.getoption("--slowest-budget") and total > BUDGET_S:
        _over.append(f"the {SLOWEST} slowest tests took {total:.0f} s, over {BUDGET_S:.0f} s")
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the slowest tests, their total and the budget."""
    top = slowest(_durations)
    if not top:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"{len(top)} slowest tests (setup + call + teardown)")
    for nodeid, seconds in top:
        write(f"{seconds:8.1f} s  {nodeid}")
    total = sum(s for _, s in top)
    write(f"{total:8.1f} s  in all (budget {BUDGET_S:.0f} s on {CPU}, tests/time_budget.py)")
    files = by_file(_durations)
    terminalreporter.section(f"{len(files)} slowest test files (every test's phases summed)")
    for path, seconds, tests in files:
        write(f"{seconds:8.1f} s  {tests:4d} tests  {path}")
    write(f"{sum(_durations.values()):8.1f} s  every test of the run ({len(_durations)} tests)")
    if _starts:
        terminalreporter.section(f"{sum(_starts.values())} real server starts in this process")
        for nodeid, count in sorted(_starts.items(), key=lambda kv: (-kv[1], kv[0])):
            write(f"{count:4d}  {nodeid}")
    for line in _over:
        write(f"FAILED time budget: {line}", red=True)
