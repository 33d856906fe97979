"""The e2e bench on a busy machine: repeats interleaved per probe, medians of paired ratios with
their spread, rows flagged noisy, and the foreign load read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from semblend_sglang.bench.client import Answer
from semblend_sglang.bench.e2e_runner import ProbeRecord, Runner, requests_per_group
from semblend_sglang.bench.e2e_summary import (
    NOISY_SPREAD,
    noise_columns,
    paired_ratios,
    relative_spread,
    summarize,
)
from semblend_sglang.bench.machine_load import (
    FOREIGN_LOAD_LIMIT,
    LoadMeter,
    listening_pid,
    process_tree,
)
from semblend_sglang.bench.report import console_table, spread_label
from semblend_sglang.bench.workloads import BenchRequest, RequestGroup, Workload


def _rec(system: str, kind: str, ttft: float, repeat: int, group: str = "g0", **kw: Any) -> Any:
    return ProbeRecord(
        "rag", 512, group, 0, system, kind, ttft, 512, 0, repeat=repeat, donors=1, **kw
    )


def test_ratios_are_medians_of_pairs_measured_in_the_same_repeat() -> None:
    # repeat 1 ran during a burst that slowed both systems 3x: paired, it changes nothing
    records = []
    for repeat, slow in ((0, 1.0), (1, 3.0), (2, 1.0)):
        records.append(_rec("vanilla", "cold", 4.0 * slow, repeat))
        records.append(_rec("vanilla", "exact_same_length", 1.0 * slow, repeat))
        records.append(_rec("exact_spans", "semantic", 1.1 * slow, repeat, outcome="materialized"))
    assert (
        paired_ratios(records, ("exact_spans", "semantic"), ("vanilla", "cold"))
        == [pytest.approx(1.1 / 4.0)] * 3
    )
    (row,) = summarize(records)
    assert row["exact_spans_over_exact"] == pytest.approx(1.1)
    assert row["exact_spans_over_exact_min"] == pytest.approx(1.1)
    assert row["exact_spans_over_exact_n"] == 3
    assert row["exact_spans_speedup"] == pytest.approx(4.0 / 1.1)
    assert row["exact_spans_ms_p50"] == pytest.approx(1100.0)  # the TTFT cell keeps the burst
    assert row["exact_spans_ms_max"] == pytest.approx(3300.0)
    assert row["noisy"] is False and row["noisy_why"] is None
    assert spread_label(row, "exact_spans_ms_p50") == "±100%"
    assert spread_label(row, "exact_spans_over_exact") == "±0%"


def test_a_ratio_that_ranges_widely_flags_its_row_and_says_why() -> None:
    records = []
    for repeat, spans in ((0, 1.0), (1, 1.0), (2, 1.6)):  # one pair 60% off
        records.append(_rec("vanilla", "exact_same_length", 1.0, repeat))
        records.append(_rec("exact_spans", "semantic", spans, repeat, outcome="materialized"))
    (row,) = summarize(records)
    assert relative_spread([1.0, 1.0, 1.6]) == pytest.approx(0.6)
    assert NOISY_SPREAD < 0.6
    assert row["noisy"] is True
    assert "spans/exact ranges 1.00-1.60 over 3 pairs" in row["noisy_why"]
    table = console_table([row])
    assert "noisy: rag 512: spans/exact ranges 1.00-1.60" in table
    assert table.splitlines()[2].split()[-1] == "!"


def test_foreign_load_flags_a_row_even_when_its_ratios_agree() -> None:
    quiet = [_rec("vanilla", "cold", 4.0, r, foreign_cores=0.02) for r in range(3)]
    busy = [*quiet[:2], _rec("vanilla", "cold", 4.0, 2, foreign_cores=0.9)]
    assert noise_columns(quiet, {})["noisy"] is False
    flagged = noise_columns(busy, {})
    assert flagged["noisy"] is True and flagged["foreign_cores_max"] == pytest.approx(0.9)
    assert "other processes used up to 0.90 cores" in flagged["noisy_why"]
    assert 0.02 < FOREIGN_LOAD_LIMIT < 0.9


def test_control_rows_pair_the_miss_overhead_per_probe() -> None:
    records = []
    for repeat, cold, spans in ((0, 4.0, 4.2), (1, 8.0, 8.64), (2, 4.0, 4.0)):
        for rec in (
            _rec("vanilla", "cold", cold, repeat),
            _rec("exact_spans", "semantic", spans, repeat, outcome="declined:no_donor"),
        ):
            rec.donors = 0
            rec.workload = "control"
            records.append(rec)
    (row,) = summarize(records)
    assert row["exact_spans_miss_overhead"] == pytest.approx(0.05)  # median of 5%, 8%, 0%
    assert row["exact_spans_miss_overhead_min"] == pytest.approx(0.0)
    assert row["exact_spans_miss_overhead_max"] == pytest.approx(0.08)
    assert spread_label(row, "exact_spans_miss_overhead") == "±4"  # points


class _RecordingClient:
    """In-memory stand-in for :class:`.client.ServerClient` that logs every call."""

    def __init__(self, name: str, log: list[tuple[str, str, int]], semblend: bool) -> None:
        self.name, self.log, self.semblend = name, log, semblend
        self.url = f"memory://{name}"

    def generate(
        self, ids: Any, tokens: int, *, margins: bool = False, passages: Any = ()
    ) -> Answer:
        self.log.append((self.name, "generate", tokens))
        return Answer(0.01, len(ids), 0, tuple(range(tokens)), "x", (1.0,) * tokens * margins)

    def flush(self) -> None:
        self.log.append((self.name, "flush", 0))

    def snapshot(self) -> dict[str, Any] | None:
        return {"outcomes": {}, "reused_tokens": 0} if self.semblend else None

    def config(self) -> dict[str, Any] | None:
        return {} if self.semblend else None

    def reference_logprobs(self, prompt: Any, reference: Any) -> list[float]:
        self.log.append((self.name, "reference", 0))
        return [-1.0] * len(reference)

    def cold_replay_logprobs(self, prompt: Any, answer: Any) -> list[float]:
        self.log.append((self.name, "replay", len(answer)))
        return [-1.0] * len(answer)


def test_runner_interleaves_systems_per_probe_and_decodes_in_the_first_repeat_only() -> None:
    log: list[tuple[str, str, int]] = []
    clients: Any = {
        "exact_spans": _RecordingClient("exact_spans", log, True),
        "vanilla": _RecordingClient("vanilla", log, False),
    }
    donor = BenchRequest(tuple(range(1, 300)), "donor")
    probe = BenchRequest(tuple(range(2, 300)), "probe", reference_ids=(5, 6))
    group = RequestGroup("g0", (donor, probe))
    workload = Workload("rag", 512, (group,))
    steps: list[int] = []
    runner = Runner(clients, greedy_tokens=4, repeats=3, meter=LoadMeter(), progress=steps.append)
    runner.run_group(workload, group)
    by_repeat = [[(r.system, r.kind) for r in runner.records if r.repeat == k] for k in range(3)]
    assert (
        by_repeat == [[("exact_spans", "semantic"), ("vanilla", "prefix"), ("vanilla", "cold")]] * 3
    )
    decoded = [(r.repeat, len(r.output_ids)) for r in runner.records if r.kind != "prefix"]
    assert decoded == [(0, 4), (0, 4), (1, 1), (1, 1), (2, 1), (2, 1)]
    assert sum(1 for _, what, _ in log if what == "reference") == 2  # first repeat only
    assert all(r.foreign_cores is not None for r in runner.records)
    # every repeat starts the probe from flushed servers and its donors again; the first
    # repeat's semantic reference too (it must not reuse the probe held as a donor)
    flushes = [n for n, what, _ in log if what == "flush"]
    assert flushes == ["exact_spans"] + ["exact_spans", "vanilla", "vanilla"] * 3
    semantic_log = [what for name, what, _ in log if name == "exact_spans"]
    assert semantic_log[:7] == [
        *("flush", "generate", "generate", "replay"),  # the answer replayed cold: no flush
        *("flush", "generate", "reference"),
    ]
    # the first repeat's decoded answers are replayed (semantic, cold), each once, whole
    assert [(n, k) for n, what, k in log if what == "replay"] == [
        ("exact_spans", 4),
        ("vanilla", 4),
    ]
    assert all(
        r.replay_logprobs == [-1.0] * 4
        for r in runner.records
        if r.repeat == 0 and r.kind != "prefix"
    )
    assert all(not r.replay_logprobs for r in runner.records if r.repeat > 0)
    # progress counts vanilla's exact_same_length too (skipped here: nothing was reused) and the
    # donor resent before the semantic reference
    assert requests_per_group(group, ["vanilla", "exact_spans"], 3) == 3 * (2 + 4) + 1
    assert sum(steps) == 3 * (2 + 3) + 1  # all but the skipped exact_same_length
    with pytest.raises(ValueError, match="repeats"):
        Runner(clients, repeats=0)


def test_answers_only_sends_what_the_answers_need_and_nothing_else() -> None:
    """A quality run: the semblend probe after its donors and vanilla's cold probe, once, each
    answer replayed cold (KL); no vanilla prefix, exact hit or reference, and no donors resent
    for a reference."""
    log: list[tuple[str, str, int]] = []
    clients: Any = {
        "exact_spans": _RecordingClient("exact_spans", log, True),
        "vanilla": _RecordingClient("vanilla", log, False),
    }
    donors = (
        BenchRequest(tuple(range(1, 300)), "donor"),
        BenchRequest(tuple(range(3, 300)), "donor"),
    )
    probe = BenchRequest(tuple(range(2, 300)), "probe", reference_ids=(5, 6))
    group = RequestGroup("g0", (*donors, probe))
    steps: list[int] = []
    runner = Runner(clients, greedy_tokens=4, progress=steps.append, answers_only=True)
    runner.run_group(Workload("rag", 512, (group,)), group)
    assert [(r.system, r.kind, len(r.output_ids)) for r in runner.records] == [
        ("exact_spans", "semantic", 4),
        ("vanilla", "cold", 4),
    ]
    assert [(n, what) for n, what, _ in log] == [
        ("exact_spans", "flush"),
        ("exact_spans", "generate"),
        ("exact_spans", "generate"),
        ("exact_spans", "generate"),
        ("exact_spans", "replay"),  # KL needs no flush, no donors again
        ("vanilla", "flush"),
        ("vanilla", "generate"),
        ("vanilla", "replay"),
    ]
    assert all(not r.reference_logprobs for r in runner.records)
    assert sum(steps) == requests_per_group(group, ["vanilla", "exact_spans"], 1, True) == 4
    full = requests_per_group(group, ["vanilla", "exact_spans"], 1)
    assert full == (2 + 1) + 2 + (1 + 2 + 2)  # donors + probe, resent donors, vanilla's five
    with pytest.raises(ValueError, match="once"):
        Runner(clients, repeats=2, answers_only=True)


_BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass"


def _busy_child(seconds: float) -> int:
    """A busy loop started as this process's child (inside the bench tree)."""
    return subprocess.Popen([sys.executable, "-c", _BUSY.format(s=seconds)]).pid


def _busy_orphan(seconds: float) -> int:
    """A busy loop whose parent exits at once: reparented away from this process, outside its
    tree, like another job on the machine."""
    script = f"{sys.executable} -c '{_BUSY.format(s=seconds)}' >/dev/null 2>&1 & echo $!"
    return int(subprocess.run(["sh", "-c", script], capture_output=True, text=True).stdout)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc (Linux)")
def test_load_meter_counts_other_processes_and_not_the_bench_tree() -> None:
    """A busy loop outside the bench's tree is foreign (whatever else the machine runs); the
    same loop inside the tree (a started server's process) is the bench's own."""

    def window(pid: int, meter: LoadMeter) -> tuple[float, float, float, float]:
        time.sleep(0.3)  # let it start
        start = meter.sample()
        time.sleep(1.5)
        read_s = time.monotonic()
        end = meter.sample()
        read_s = time.monotonic() - read_s
        while os.path.exists(f"/proc/{pid}") and "zombie" not in _state(pid):
            time.sleep(0.1)
        wall = end.wall_s - start.wall_s
        own = (end.own_s - start.own_s) / wall
        busy = (end.busy_s - start.busy_s) / wall
        # The machine's counter and each process's are separate tick counts, read a moment
        # apart (the tree walk): either side of a comparison may be off by a tick per CPU at
        # each end, and the busy loop runs on while the tree is walked.
        ticks = os.sysconf("SC_CLK_TCK")
        slack = (2 * ((os.cpu_count() or 1) + 1) / ticks + 2 * read_s) / wall
        return own, busy, meter.window(start, end).foreign_cores, slack

    own, busy, foreign, slack = window(_busy_orphan(2.5), LoadMeter())
    assert own < 0.2 and foreign > 0.4 and busy >= foreign - slack, (own, busy, foreign, slack)
    child = _busy_child(2.5)
    own, busy, foreign, slack = window(child, LoadMeter([child]))
    assert own > 0.4 and busy >= own - slack, (own, busy, foreign, slack)
    os.waitpid(child, 0)
    assert process_tree([os.getpid()])[0] == os.getpid()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line for line in f if line.startswith("State:")), "").lower()
    except OSError:
        return "zombie"


def test_a_local_url_is_traced_to_the_process_listening_on_its_port() -> None:
    """The pid the bench counts as its own for a ``--url`` server: this process, listening on a
    real socket; none for another host or a port nobody listens on."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert listening_pid(f"http://127.0.0.1:{port}") == os.getpid()
        assert listening_pid(f"http://localhost:{port}/v1") == os.getpid()
        assert listening_pid(f"http://192.0.2.1:{port}") is None  # not this machine
    assert listening_pid(f"http://127.0.0.1:{port}") is None  # closed
