"""torch_native off the CPU runtime's default beside it, on the real CPU server
(docs/perf-archive.md, "Split view on the CPU server").

Two semblend (exact_spans) servers side by side: ``query_only`` (the CPU runtime's default: every
extend batch runs the query-only extend on the real batch, masked by position) and ``split_view``
(``SEMBLEND_CPU_QUERY_ONLY_EXTEND=0``: SGLang's own SDPA extend for ordinary batches; a batch
holding a sparse request took the split view through SGLang's SDPA at commit cee63e4, the split
view or the mask by tile work at 52f746b, and the mask since 6ef4cf9, after these measurements).
For each built-in workload's groups at each ``--tokens`` (cut to fit SmolLM2's context as the bench
does), on each server in turn (order alternating per repeat): flush, send the donors, then the
probe (one token, greedy). Printed per cell: each server's probe TTFT median and range, the
split/query-only TTFT ratio per repeat (paired), whether both servers reused and gave the same
first token, and how many batches holding a sparse request each server attended on each path (its
snapshot's ``sparse_extend_batches``). ``edited_ends`` is a pseudo-workload (:func:`_edited_ends`)
whose hit computes two long runs.

    .venv/bin/python scripts/split_view_cpu_ttft.py [--tokens 1024,2048] [--repeats 3]
        [--workloads cross_instruction,rag] [--semblend-env KEY=VALUE ...] [--json FILE]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click

SETUPS = {"query_only": {}, "split_view": {"SEMBLEND_CPU_QUERY_ONLY_EXTEND": "0"}}


@click.command()
@click.option("--tokens", default="1024,2048", show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--groups", default=2, show_default=True)
@click.option("--workloads", default="cross_instruction,rag", show_default=True)
@click.option(
    "--semblend-env", "env_values", multiple=True, metavar="KEY=VALUE", help="both servers"
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(
    tokens: str,
    repeats: int,
    groups: int,
    workloads: str,
    env_values: tuple[str, ...],
    json_path: Path | None,
) -> None:
    """Probe TTFT through the split view and through the query-only extend, side by side."""
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoTokenizer

    from semblend_sglang.bench.builtin_workloads import build_workload, fitting_length
    from semblend_sglang.bench.client import ServerClient
    from semblend_sglang.bench.e2e import model_context_length
    from semblend_sglang.bench.e2e_runner import GREEDY_TOKENS
    from semblend_sglang.bench.report import environment
    from semblend_sglang.bench.snapshot_deltas import outcome_delta
    from semblend_sglang.bench.systems import parse_semblend_env, start_servers
    from semblend_sglang.data import essay_texts
    from semblend_sglang.model_prep import prepare_model

    shared = parse_semblend_env(list(env_values))
    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    window = model_context_length(model) or 8192
    logs = Path("bench-results") / "split-view-cpu"
    pool = ["--mem-fraction-static", "0.8", "--max-total-tokens", "32768"]
    servers = {}
    cells: list[dict[str, object]] = []
    try:
        for name, env in SETUPS.items():
            servers[name] = start_servers(
                ["exact_spans"], model, pool, logs / name, {**shared, **env}
            )["exact_spans"]
        clients = {name: ServerClient(srv.url) for name, srv in servers.items()}
        for length_text in tokens.split(","):
            length = fitting_length(int(length_text), window, GREEDY_TOKENS)
            for workload_name in workloads.split(","):
                edited = workload_name == EDITED_ENDS
                base = "cross_instruction" if edited else workload_name
                workload = build_workload(base, tok, essay_texts(), length, groups, 11)
                rows: dict[str, list[dict[str, object]]] = {name: [] for name in SETUPS}
                for r in range(repeats):
                    for group in workload.groups:
                        donors = [d.prompt_ids for d in group.donors]
                        probe = group.probes[0].prompt_ids
                        if edited:
                            donors = donors[:1]
                            probe = _edited_ends(list(donors[0]), tok, essay_texts())
                        order = list(SETUPS) if r % 2 == 0 else list(reversed(SETUPS))
                        for name in order:
                            client = clients[name]
                            client.flush()
                            for donor in donors:
                                client.generate(donor, 1)
                            before = client.snapshot()
                            answer = client.generate(probe, 1)
                            after = client.snapshot()
                            outcome, reused = outcome_delta(before, after)
                            rows[name].append(
                                {
                                    "ttft_ms": 1000 * answer.ttft_s,
                                    "reused": reused,
                                    "outcome": outcome,
                                    "first_token": list(answer.output_ids[:1]),
                                    "paths": _path_delta(before, after),
                                }
                            )
                cells.append(_report(workload_name, length, rows))
    finally:
        for srv in servers.values():
            srv.stop()
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "environment": environment(model=model),
            "setups": SETUPS,
            "semblend_env": shared,
            "cells": cells,
        }
        json_path.write_text(json.dumps(report, indent=1))


EDITED_ENDS = "edited_ends"
"""A pseudo-workload: a cross_instruction donor whose first and last ``EDIT_TOKENS`` are
replaced by other text, so the hit computes two long runs (what the split view is for)."""
EDIT_TOKENS = 192


def _edited_ends(donor: list[int], tok: object, texts: list[str]) -> list[int]:
    """``donor`` with its first EDIT_TOKENS tokens replaced and EDIT_TOKENS more appended, both
    from the last essay (text the donor does not hold)."""
    filler = tok.encode(texts[-1], add_special_tokens=False)  # type: ignore[attr-defined]
    return filler[:EDIT_TOKENS] + donor[EDIT_TOKENS:-EDIT_TOKENS] + filler[-EDIT_TOKENS:]


def _path_delta(before: dict, after: dict) -> dict[str, int]:
    """Batches holding a sparse request per attention path between two snapshots."""
    was = before.get("sparse_extend_batches") or {}
    now = after.get("sparse_extend_batches") or {}
    return {path: int(now.get(path, 0)) - int(was.get(path, 0)) for path in now}


def _report(workload: str, length: int, rows: dict[str, list[dict[str, object]]]) -> dict:
    """Print one cell's line and return it as a dict."""
    q, s = rows["query_only"], rows["split_view"]
    ratios = [float(b["ttft_ms"]) / float(a["ttft_ms"]) for a, b in zip(q, s, strict=True)]
    same = sum(a["first_token"] == b["first_token"] for a, b in zip(q, s, strict=True))
    hits = {name: sum(int(x["reused"]) > 0 for x in got) for name, got in rows.items()}
    paths: dict[str, dict[str, int]] = {}
    for name, got in rows.items():
        for x in got:
            for path, count in dict(x["paths"]).items():  # type: ignore[call-overload]
                paths.setdefault(name, {}).setdefault(path, 0)
                paths[name][path] += count
    medians = {
        name: statistics.median(float(x["ttft_ms"]) for x in got) for name, got in rows.items()
    }
    click.echo(
        f"{workload:17s} {length:5d}  query_only {medians['query_only']:7.0f} ms  split_view "
        f"{medians['split_view']:7.0f} ms  split/query-only median {statistics.median(ratios):.3f}"
        f" (min {min(ratios):.3f}, max {max(ratios):.3f}, n={len(ratios)})  hits {hits}  "
        f"same first token {same}/{len(ratios)}  sparse batches by path {paths}"
    )
    return {
        "workload": workload,
        "tokens": length,
        "rows": rows,
        "ratios": ratios,
        "hits": hits,
        "same_first_token": same,
        "paths": paths,
    }


if __name__ == "__main__":
    main()
