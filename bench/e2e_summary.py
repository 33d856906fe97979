"""The e2e job's summary: probe records reduced to rows, one per workload and context length
or, for a user's workload file (``by_label``), one per workload, probe ``label`` and context
length. A row holds TTFT median, p90 and range per system and kind over every repeat,
server-confirmed hits and reuse per semblend system, quality against the cold run of the same
probe (first repeat), answers scored against gold answers where probes carry them (the QA
workloads; each dataset on its own, paired with the cold run), the recompute settings the
system's server resolved and what its recompute budget and quality gate did, and on control
rows (no probe in the row has a donor) the miss overhead. Ratios (spans/exact, speed-up over
cold, miss overhead) are medians of per-probe paired ratios: both requests of a pair measured
in the same repeat of the same probe. A row is ``noisy`` when a paired ratio's range exceeds
:data:`NOISY_SPREAD` of its median or another process took more than
:data:`.machine_load.FOREIGN_LOAD_LIMIT` cores while it was measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..presets import REPAIR_SETTINGS
from .e2e_runner import GREEDY_TOKENS, ProbeRecord
from .machine_load import FOREIGN_LOAD_LIMIT
from .metrics import (
    divergence_margin,
    first_divergence,
    greedy_agreement,
    mean_or_none,
    percentile,
    ppl_ratio,
    rouge_l,
)
from .qa_summary import qa_columns
from .snapshot_deltas import declined_reasons
from .systems import REORDER, REORDER_SPANS, SEMBLEND_SERVERS, SGLANG_DISPATCH

TTFT_KINDS: tuple[tuple[str, str], ...] = (
    ("vanilla", "cold"),
    ("vanilla", "prefix"),
    ("vanilla", "exact_same_length"),
    ("exact_spans", "semantic"),
    ("substitute", "semantic"),
    (SGLANG_DISPATCH, "semantic"),
    (REORDER, "reordered"),
    (REORDER_SPANS, "semantic"),
)
"""(system, kind) pairs with TTFT columns: ``{kind}_ms_*`` for vanilla, ``{system}_ms_*`` else."""

RECOMPUTE_SETTINGS = (*REPAIR_SETTINGS[:2], "recompute_check_layer", *REPAIR_SETTINGS[2:])
"""The resolved settings (keys of the server's snapshot ``config``) each semblend system's rows
repeat as ``{system}_{setting}``, in this order: a request's repair settings
(:data:`~semblend_sglang.presets.REPAIR_SETTINGS`) and the server's check layer; None where the
server did not report one (an older server)."""
QUALITY_GATE = "quality_gate"
"""The decline reason of a reuse the quality gate turned into a full recompute."""

NOISY_SPREAD = 0.25
"""A paired ratio whose range (max - min) exceeds this share of its median flags its row as
noisy (docs/bench.md, "Noise")."""

PAIRED_RATIOS: tuple[tuple[str, tuple[str, str], tuple[str, str], str], ...] = (
    (
        "exact_spans_over_exact",
        ("exact_spans", "semantic"),
        ("vanilla", "exact_same_length"),
        "spans/exact",
    ),
    ("exact_spans_speedup", ("vanilla", "cold"), ("exact_spans", "semantic"), "speed-up"),
    (
        "exact_spans_over_reorder",
        ("exact_spans", "semantic"),
        (REORDER, "reordered"),
        "spans/reorder",
    ),
    (
        "reorder_spans_speedup",
        ("vanilla", "cold"),
        (REORDER_SPANS, "semantic"),
        "reorder_spans speed-up",
    ),
    (
        "reorder_spans_over_reorder",
        (REORDER_SPANS, "semantic"),
        (REORDER, "reordered"),
        "reorder_spans/reorder",
    ),
)
"""(summary key, numerator, denominator, name in a noise reason): per-probe paired TTFT ratios
of every row; the miss overhead is paired the same way on control rows."""

_Key = tuple[str, str | None, int]
_Pair = tuple[str, int, int]


def row_name(row: dict[str, Any]) -> str:
    """How tables and plots name a row: ``workload``, or ``workload:label`` for a row of one
    label (an empty label shows as ``(no label)``)."""
    label = row.get("label")
    if label is None:
        return str(row["workload"])
    return f"{row['workload']}:{label or '(no label)'}"


def _row_keys(records: Sequence[ProbeRecord], by_label: bool) -> list[_Key]:
    """(workload, label or None, context length) of every row: by context length, then
    workload name, then a label's first appearance in ``records``."""
    first_seen: dict[str, int] = {}
    for r in records:
        first_seen.setdefault(r.label, len(first_seen))
    keys = {(r.workload, r.label if by_label else None, r.context_tokens) for r in records}
    return sorted(keys, key=lambda k: (k[2], k[0], -1 if k[1] is None else first_seen[k[1]]))


def _ttft_columns(mine: Sequence[ProbeRecord]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system, kind in TTFT_KINDS:
        ttfts = [1000 * r.ttft_s for r in mine if r.system == system and r.kind == kind]
        name = kind if system == "vanilla" else system
        out[f"{name}_ms_p50"] = percentile(ttfts, 50) if ttfts else None
        out[f"{name}_ms_p90"] = percentile(ttfts, 90) if ttfts else None
        out[f"{name}_ms_min"] = min(ttfts) if ttfts else None
        out[f"{name}_ms_max"] = max(ttfts) if ttfts else None
        out[f"{name}_n"] = len(ttfts)
    return out


def _ttft_by_pair(mine: Sequence[ProbeRecord], system: str, kind: str) -> dict[_Pair, float]:
    return {
        (r.group_id, r.probe, r.repeat): r.ttft_s
        for r in mine
        if r.system == system and r.kind == kind
    }


def paired_ratios(
    mine: Sequence[ProbeRecord], num: tuple[str, str], den: tuple[str, str]
) -> list[float]:
    """TTFT of ``num`` over TTFT of ``den`` ((system, kind) each) for every (group, probe,
    repeat) measured on both, in record order."""
    a = _ttft_by_pair(mine, *num)
    b = _ttft_by_pair(mine, *den)
    return [a[k] / b[k] for k in a if k in b and b[k] > 0]


def _ratio_columns(key: str, ratios: Sequence[float], offset: float = 0.0) -> dict[str, Any]:
    """``key`` (median), ``key_min``, ``key_max`` and ``key_n`` of ``ratios`` minus
    ``offset`` (1 for an overhead); None when there are none."""
    if not ratios:
        return {key: None, f"{key}_min": None, f"{key}_max": None, f"{key}_n": 0}
    return {
        key: percentile(ratios, 50) - offset,
        f"{key}_min": min(ratios) - offset,
        f"{key}_max": max(ratios) - offset,
        f"{key}_n": len(ratios),
    }


def relative_spread(values: Sequence[float]) -> float:
    """``(max - min) / median`` of positive ``values`` (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    mid = percentile(values, 50)
    return (max(values) - min(values)) / mid if mid > 0 else float("inf")


def noise_columns(mine: Sequence[ProbeRecord], ratios: dict[str, list[float]]) -> dict[str, Any]:
    """``noisy``, ``noisy_why`` (one line; None when not noisy) and ``foreign_cores_max`` of a
    row: noisy when a paired ratio in ``ratios`` (name -> values) ranges over more than
    :data:`NOISY_SPREAD` of its median, or another process used more than
    :data:`FOREIGN_LOAD_LIMIT` cores during one of the row's requests."""
    why: list[str] = []
    for name, values in ratios.items():
        spread = relative_spread(values)
        if spread > NOISY_SPREAD:
            why.append(
                f"{name} ranges {min(values):.2f}-{max(values):.2f} over {len(values)} pairs "
                f"({spread:.0%} of its median)"
            )
    loads = [r.foreign_cores for r in mine if r.foreign_cores is not None]
    worst = max(loads) if loads else None
    if worst is not None and worst > FOREIGN_LOAD_LIMIT:
        why.append(f"other processes used up to {worst:.2f} cores during its requests")
    return {
        "noisy": bool(why),
        "noisy_why": "; ".join(why) if why else None,
        "foreign_cores_max": worst,
    }


def _system_columns(
    system: str,
    probes: Sequence[ProbeRecord],
    mine: Sequence[ProbeRecord],
    cold_of: dict[tuple[str, int], ProbeRecord],
    control: bool,
    config: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Hits, reuse, recompute and quality of one semblend system's probes (``config``: the
    settings its server resolved); miss overhead on control rows."""
    out: dict[str, Any] = {}
    hits = [r for r in probes if r.outcome == "materialized"]
    out[f"{system}_hit_rate"] = len(hits) / len(probes)
    for name in ("hook_ms", "copy_ms"):
        values = [v for r in hits if (v := getattr(r, name)) is not None]
        out[f"{system}_hit_{name}"] = percentile(values, 50) if values else None
    reused = sum(r.reused_tokens or 0 for r in probes)
    out[f"{system}_reused_fraction"] = reused / max(1, sum(r.prompt_tokens for r in probes))
    probes = [r for r in probes if r.repeat == 0]  # counts and quality: the decoding repeat
    first_reused = sum(r.reused_tokens or 0 for r in probes)
    out.update(_recompute_columns(system, probes, first_reused, config))
    ratios: list[float] = []
    agreements: list[tuple[bool, float]] = []
    rouges: list[tuple[bool, float]] = []
    divergent = 0
    margins: list[float] = []
    for r in probes:
        cold = cold_of.get((r.group_id, r.probe))
        if cold is None:
            continue
        if r.reference_logprobs and cold.reference_logprobs:
            ratios.append(ppl_ratio(r.reference_logprobs, cold.reference_logprobs))
        hit = r.outcome == "materialized"
        agreements.append((hit, greedy_agreement(r.output_ids, cold.output_ids, GREEDY_TOKENS)))
        n = GREEDY_TOKENS
        if hit and first_divergence(r.output_ids[:n], cold.output_ids[:n]) is not None:
            divergent += 1
            margin = divergence_margin(r.output_ids, cold.output_ids, cold.margins, GREEDY_TOKENS)
            if margin is not None:
                margins.append(margin)
        rouges.append((hit, rouge_l(r.text, cold.text)))
    out.update(_hit_kl_columns(system, [r for r in probes if r.outcome == "materialized"]))
    out[f"{system}_ppl_ratio"] = percentile(ratios, 50) if ratios else None
    out[f"{system}_ppl_ratio_max"] = max(ratios) if ratios else None
    out[f"{system}_divergent_hits"] = divergent
    out[f"{system}_divergence_margin"] = percentile(margins, 50) if margins else None
    out[f"{system}_divergence_margin_max"] = max(margins) if margins else None
    for name, values in (("greedy_agreement", agreements), ("rouge_l", rouges)):
        out[f"{system}_{name}"] = mean_or_none([v for _, v in values])
        out[f"{system}_{name}_hits"] = mean_or_none([v for hit, v in values if hit])
    if control:
        pairs = paired_ratios(mine, (system, "semantic"), ("vanilla", "cold"))
        if pairs:
            out.update(_ratio_columns(f"{system}_miss_overhead", pairs, offset=1.0))
        cold_ttfts = [1000 * r.ttft_s for r in mine if r.system == "vanilla" and r.kind == "cold"]
        hook = [r.hook_ms for r in mine if r.system == system and r.hook_ms is not None]
        if hook and cold_ttfts:
            out[f"{system}_miss_hook_ms"] = percentile(hook, 50)
            out[f"{system}_miss_overhead_in_scheduler"] = percentile(hook, 50) / percentile(
                cold_ttfts, 50
            )
    return out


def _kls(records: Sequence[ProbeRecord]) -> list[float]:
    return [v for r in records if (v := r.kl) is not None]


def kl_columns(prefix: str, records: Sequence[ProbeRecord]) -> dict[str, Any]:
    """``{prefix}_kl`` (mean of :attr:`.ProbeRecord.kl` over ``records``, as SGLang averages its
    samples) and ``{prefix}_kl_max``; None without a replayed record."""
    kls = _kls(records)
    return {f"{prefix}_kl": mean_or_none(kls), f"{prefix}_kl_max": max(kls) if kls else None}


def _hit_kl_columns(system: str, hits: Sequence[ProbeRecord]) -> dict[str, Any]:
    """KL of a semblend system's materialized probes: all of them, and split by the spans the
    server materialized (one span: another instruction in front; several: a multi-span plan)."""
    out = kl_columns(system, hits)
    one = [r for r in hits if r.spans == 1]
    multi = [r for r in hits if (r.spans or 0) > 1]
    out[f"{system}_kl_one_span"] = mean_or_none(_kls(one))
    out[f"{system}_kl_multi_span"] = mean_or_none(_kls(multi))
    return out


def _recompute_columns(
    system: str,
    probes: Sequence[ProbeRecord],
    reused: int,
    config: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The resolved recompute settings, the quality gate's declines, the recomputed tokens and
    their share of the positions matched to a donor (reused + recomputed)."""
    out: dict[str, Any] = {f"{system}_{k}": (config or {}).get(k) for k in RECOMPUTE_SETTINGS}
    out[f"{system}_gate_declines"] = sum(
        QUALITY_GATE in declined_reasons(r.outcome) for r in probes
    )
    recomputed = sum(r.recomputed_tokens or 0 for r in probes)
    out[f"{system}_recomputed_tokens"] = recomputed
    matched = reused + recomputed
    out[f"{system}_recompute_share"] = recomputed / matched if matched else None
    return out


def _reorder_columns(
    mine: Sequence[ProbeRecord], cold_of: dict[tuple[str, int], ProbeRecord]
) -> dict[str, Any]:
    """The reorder system's exact prefix hit (``reorder_cached_fraction``: SGLang's cached
    tokens over the prompt, every repeat) and its first repeat's 32-token greedy agreement with
    vanilla's cold run of the original prompt (``reorder_greedy_agreement``); None without
    reorder records; the reorder_spans system's ``reorder_spans_cached_fraction`` (SGLang's
    exact prefix over the prompt), ``reorder_spans_held_fraction`` (that plus semblend's reuse)
    and ``reorder_spans_reordered`` (the share of its probes the server reordered)."""
    runs = [r for r in mine if r.system == REORDER and r.kind == "reordered"]
    agree = [
        greedy_agreement(r.output_ids, cold_of[(r.group_id, r.probe)].output_ids, GREEDY_TOKENS)
        for r in runs
        if r.repeat == 0 and (r.group_id, r.probe) in cold_of
    ]
    prompt = sum(r.prompt_tokens for r in runs)
    spans = [r for r in mine if r.system == REORDER_SPANS and r.kind == "semantic"]
    spans_prompt = sum(r.prompt_tokens for r in spans)
    held = sum(r.cached_tokens + (r.reused_tokens or 0) for r in spans)
    moved = [r.passage_order != sorted(r.passage_order) for r in spans if r.passage_order]
    return {
        "reorder_cached_fraction": sum(r.cached_tokens for r in runs) / prompt if prompt else None,
        "reorder_greedy_agreement": mean_or_none(agree),
        "reorder_spans_cached_fraction": (
            sum(r.cached_tokens for r in spans) / spans_prompt if spans_prompt else None
        ),
        "reorder_spans_held_fraction": held / spans_prompt if spans_prompt else None,
        "reorder_spans_reordered": mean_or_none(moved),
    }


def summarize(
    records: Sequence[ProbeRecord],
    by_label: bool = False,
    configs: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> list[dict[str, Any]]:
    """Rows of ``records`` (see the module doc), ordered by context length, workload, then
    label in order of first appearance. ``configs``: system -> the settings its server resolved
    (:attr:`.e2e_runner.Runner.configs`; a system missing or None: settings unknown). Every row
    has ``workload``, ``label`` (None unless ``by_label``), ``context_tokens`` and ``control``;
    TTFT p50/p90 and counts per :data:`TTFT_KINDS`; per semblend system that ran: each of
    :data:`RECOMPUTE_SETTINGS` as ``_{setting}``, ``_gate_declines`` (probes the quality gate
    declined), ``_recomputed_tokens`` (reused positions recomputed, summed),
    ``_recompute_share`` (of reused + recomputed tokens; None when both are 0), ``_hit_rate``,
    ``_hit_hook_ms`` and ``_hit_copy_ms`` (medians over the materialized probes, every repeat;
    None without them), ``_reused_fraction``,
    ``_ppl_ratio`` (median; ``_max``), ``_greedy_agreement``, ``_rouge_l`` against the vanilla
    cold run of the same probe (and ``_greedy_agreement_hits``, ``_rouge_l_hits``: over the
    probes the server materialized only), ``_divergent_hits`` (materialized probes whose first
    32 greedy tokens differ from cold) with ``_divergence_margin`` (median; ``_max``): the cold
    run's top-1 / top-2 logprob margin where they first differ (None when no cold run recorded
    margins: schema 4 and older), and on control rows
    ``_miss_overhead``,
    ``_miss_hook_ms`` and ``_miss_overhead_in_scheduler``; ``exact_greedy_agreement`` (the exact
    hit's own agreement, the noise floor) and ``exact_spans_over_exact``; the answers scored
    against gold answers (:func:`qa_columns`: ``qa_probes``, ``qa_span_probes`` and
    ``qa_by_dataset``: per dataset and source, accuracy, exact match, F1, agreement with cold
    and McNemar's paired test); the reorder system's ``reorder_cached_fraction`` and
    ``reorder_greedy_agreement`` (:func:`_reorder_columns`) and the paired
    ``exact_spans_over_reorder``; SGLang's KL measure (:func:`kl_columns`, mean and ``_max``):
    per semblend system over its materialized probes (``_kl``, and ``_kl_one_span`` /
    ``_kl_multi_span`` by the spans materialized), ``exact_kl`` (the exact hit of the same
    length: the floor), ``cold_kl`` (the cold run's decode against its own prefill) and
    ``reorder_kl``. A missing value is None."""
    rows: list[dict[str, Any]] = []
    for workload, label, ctx in _row_keys(records, by_label):
        mine = [
            r
            for r in records
            if r.workload == workload
            and r.context_tokens == ctx
            and (label is None or r.label == label)
        ]
        cold_of = {
            (r.group_id, r.probe): r
            for r in mine
            if r.system == "vanilla" and r.kind == "cold" and r.repeat == 0
        }
        control = all(r.donors == 0 for r in mine)
        row: dict[str, Any] = {
            "workload": workload,
            "label": label,
            "context_tokens": ctx,
            "control": control,
        }
        row.update(_ttft_columns(mine))
        for system in SEMBLEND_SERVERS:
            probes = [r for r in mine if r.system == system and r.kind == "semantic"]
            if probes:
                config = (configs or {}).get(system)
                row.update(_system_columns(system, probes, mine, cold_of, control, config))
        exact_agree = [
            greedy_agreement(r.output_ids, cold_of[(r.group_id, r.probe)].output_ids)
            for r in mine
            if r.system == "vanilla"
            and r.kind == "exact_same_length"
            and r.repeat == 0
            and (r.group_id, r.probe) in cold_of
        ]
        # The noise floor: the same prompt, cached vs not, on the same server.
        row["exact_greedy_agreement"] = mean_or_none(exact_agree)
        for prefix, system, kind in (
            ("exact", "vanilla", "exact_same_length"),
            ("cold", "vanilla", "cold"),
            (REORDER, REORDER, "reordered"),
        ):
            runs = [r for r in mine if r.system == system and r.kind == kind and r.repeat == 0]
            row.update(kl_columns(prefix, runs))
        row.update(_reorder_columns(mine, cold_of))
        row.update(qa_columns(mine))
        spread: dict[str, list[float]] = {}
        for key, num, den, name in PAIRED_RATIOS:
            ratios = paired_ratios(mine, num, den)
            row.update(_ratio_columns(key, ratios))
            spread[name] = ratios
        if control:
            spread["miss TTFT ratio"] = paired_ratios(
                mine, ("exact_spans", "semantic"), ("vanilla", "cold")
            )
        row.update(noise_columns(mine, spread))
        rows.append(row)
    return rows
