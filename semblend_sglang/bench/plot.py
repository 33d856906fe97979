"""The e2e job's figure (PNG): TTFT per system, and quality against the cold run per workload."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .systems import SGLANG_DISPATCH


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """PNG: TTFT p50 by context length per system (workloads with donors); quality per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    lengths = sorted({r["context_tokens"] for r in rows})
    for key, label in (
        ("cold_ms_p50", "cold (vanilla)"),
        ("prefix_ms_p50", "vanilla, donor cached"),
        ("exact_same_length_ms_p50", "exact hit, same length"),
        ("exact_spans_ms_p50", "semblend exact_spans"),
        ("substitute_ms_p50", "semblend substitute"),
        (f"{SGLANG_DISPATCH}_ms_p50", "exact_spans, SGLang's DP dispatch"),
    ):
        ys = []
        for n in lengths:
            vals = [
                r[key]
                for r in rows
                if r["context_tokens"] == n and r["workload"] != "control" and r.get(key)
            ]
            ys.append(sum(vals) / len(vals) if vals else float("nan"))
        ax1.plot(lengths, ys, marker="o", label=label)
    ax1.set_xlabel("context tokens")
    ax1.set_ylabel("TTFT p50 (ms), mean over workloads")
    ax1.set_title("Time to first token")
    ax1.legend(fontsize=8)
    workloads = sorted({r["workload"] for r in rows if r["workload"] != "control"})
    xs = range(len(workloads))
    for offset, (key, label) in enumerate(
        (
            ("exact_spans_greedy_agreement", "exact_spans: greedy agreement"),
            ("exact_spans_rouge_l", "exact_spans: ROUGE-L"),
            ("substitute_greedy_agreement", "substitute: greedy agreement"),
        )
    ):
        vals = []
        for w in workloads:
            got = [r[key] for r in rows if r["workload"] == w and r.get(key) is not None]
            vals.append(sum(got) / len(got) if got else 0.0)
        ax2.bar([x + 0.27 * (offset - 1) for x in xs], vals, width=0.27, label=label)
    ax2.set_xticks(list(xs), workloads, rotation=15)
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Quality vs cold (1.0 = identical)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
