"""Bench records of scored QA probes for the summary tests (test_bench_qa.py and the workload
tests): what the e2e runner keeps for one probe's first decode, with its gold answer."""

from __future__ import annotations

from collections.abc import Sequence

from semblend_sglang.bench.e2e_runner import ProbeRecord
from semblend_sglang.bench.workloads import GoldAnswer


def qa_record(
    workload: str,
    system: str,
    kind: str,
    group: str,
    text: str,
    gold: GoldAnswer,
    *,
    repeat: int = 0,
    ids: Sequence[int] = (),
    donors: int = 1,
) -> ProbeRecord:
    """A record of probe 0 of ``group`` at 1,024 tokens on ``system`` (``kind``: its request kind,
    e.g. ``cold`` or ``semantic``), 1 ms TTFT, 1,000 prompt tokens, answering ``text`` (output
    ids ``ids``) to a question whose gold is ``gold``; a semblend system's outcome is
    ``materialized``. Builds the record only: nothing is sent or scored."""
    return ProbeRecord(
        workload,
        1024,
        group,
        0,
        system,
        kind,
        1.0,
        1000,
        0,
        output_ids=list(ids),
        text=text,
        donors=donors,
        repeat=repeat,
        gold=gold,
        outcome="materialized" if system != "vanilla" else None,
    )
