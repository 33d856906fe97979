"""The e2e job's summary: probe records reduced to one row per workload and context length
(TTFT percentiles per system and kind, server-confirmed hits and reuse, quality against the
cold run, the miss overhead on control rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .e2e_runner import GREEDY_TOKENS, ProbeRecord
from .metrics import greedy_agreement, miss_overhead, percentile, ppl_ratio, rouge_l
from .systems import SEMBLEND_SYSTEMS, SGLANG_DISPATCH


def summarize(records: Sequence[ProbeRecord]) -> list[dict[str, Any]]:
    """One row per (workload, context length): TTFTs, hits and quality (see module doc)."""
    rows: list[dict[str, Any]] = []
    keys = sorted({(r.workload, r.context_tokens) for r in records}, key=lambda k: (k[1], k[0]))
    for workload, ctx in keys:
        mine = [r for r in records if r.workload == workload and r.context_tokens == ctx]
        by = {(r.system, r.kind, r.group_id, r.probe): r for r in mine}
        row: dict[str, Any] = {"workload": workload, "context_tokens": ctx}
        for system, kind in (
            ("vanilla", "cold"),
            ("vanilla", "prefix"),
            ("vanilla", "exact_same_length"),
            ("exact_spans", "semantic"),
            ("substitute", "semantic"),
            (SGLANG_DISPATCH, "semantic"),
        ):
            ttfts = [1000 * r.ttft_s for r in mine if r.system == system and r.kind == kind]
            name = kind if system == "vanilla" else system
            row[f"{name}_ms_p50"] = percentile(ttfts, 50) if ttfts else None
            row[f"{name}_ms_p90"] = percentile(ttfts, 90) if ttfts else None
            row[f"{name}_n"] = len(ttfts)
        for system in SEMBLEND_SYSTEMS:
            probes = [r for r in mine if r.system == system and r.kind == "semantic"]
            if not probes:
                continue
            hits = [r for r in probes if r.outcome == "materialized"]
            row[f"{system}_hit_rate"] = len(hits) / len(probes)
            row[f"{system}_reused_fraction"] = sum(r.reused_tokens or 0 for r in probes) / max(
                1, sum(r.prompt_tokens for r in probes)
            )
            ratios, agreements, rouges = [], [], []
            for r in probes:
                cold = by.get(("vanilla", "cold", r.group_id, r.probe))
                if cold is None:
                    continue
                if r.reference_logprobs and cold.reference_logprobs:
                    ratios.append(ppl_ratio(r.reference_logprobs, cold.reference_logprobs))
                agreements.append(greedy_agreement(r.output_ids, cold.output_ids, GREEDY_TOKENS))
                rouges.append(rouge_l(r.text, cold.text))
            row[f"{system}_ppl_ratio"] = percentile(ratios, 50) if ratios else None
            row[f"{system}_ppl_ratio_max"] = max(ratios) if ratios else None
            row[f"{system}_greedy_agreement"] = (
                sum(agreements) / len(agreements) if agreements else None
            )
            row[f"{system}_rouge_l"] = sum(rouges) / len(rouges) if rouges else None
            if workload == "control":
                cold_ttfts = [
                    1000 * r.ttft_s for r in mine if r.system == "vanilla" and r.kind == "cold"
                ]
                if cold_ttfts:
                    row[f"{system}_miss_overhead"] = miss_overhead(
                        [1000 * r.ttft_s for r in probes], cold_ttfts
                    )
                hook = [r.hook_ms for r in probes if r.hook_ms is not None]
                if hook and cold_ttfts:
                    row[f"{system}_miss_hook_ms"] = percentile(hook, 50)
                    row[f"{system}_miss_overhead_in_scheduler"] = percentile(hook, 50) / percentile(
                        cold_ttfts, 50
                    )
        exact_agree = []
        for r in mine:
            if r.system == "vanilla" and r.kind == "exact_same_length":
                cold = by.get(("vanilla", "cold", r.group_id, r.probe))
                if cold is not None:
                    exact_agree.append(greedy_agreement(r.output_ids, cold.output_ids))
        # The noise floor: the same prompt, cached vs not, on the same server.
        row["exact_greedy_agreement"] = sum(exact_agree) / len(exact_agree) if exact_agree else None
        if row.get("exact_spans_ms_p50") and row.get("exact_same_length_ms_p50"):
            row["exact_spans_over_exact"] = (
                row["exact_spans_ms_p50"] / row["exact_same_length_ms_p50"]
            )
        rows.append(row)
    return rows
