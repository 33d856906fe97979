"""Does a long semantic hit take one forward pass under a small ``--chunked-prefill-size``, and at
what TTFT beside the same request without chunking? (docs/perf-archive.md, "Long prompts: 4,096
and 8,192 tokens")

Two semblend (exact_spans) servers side by side: one with ``--chunked-prefill-size CHUNK``, one
with ``--chunked-prefill-size -1`` (no chunking). For each built-in ``cross_instruction`` group
at ``--tokens`` (cut to fit SmolLM2's context as the bench does), on each server in turn (the
order alternates per repeat): flush, send the donor, then the probe (streamed, one token). The
probe's prefill passes are the ``Prefill batch`` lines its server logged meanwhile; its computed
tokens are the prompt minus what semblend reused (its counters). Printed: per server, the
probe's TTFT median and spread, passes and computed tokens; the chunked/unchunked TTFT ratio
per repeat (paired).

    .venv/bin/python scripts/chunked_long_hit.py [--tokens 8192] [--chunk 1024] [--repeats 3]
        [--semblend-env SEMBLEND_RECOMPUTE_RATIO=0.05] [--json FILE]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click


def _passes(log: Path) -> int:
    return log.read_text(errors="replace").count("Prefill batch")


@click.command()
@click.option("--tokens", default=8192, show_default=True)
@click.option("--chunk", default=1024, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--groups", default=1, show_default=True)
@click.option("--semblend-env", "env_values", multiple=True, metavar="KEY=VALUE")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(
    tokens: int,
    chunk: int,
    repeats: int,
    groups: int,
    env_values: tuple[str, ...],
    json_path: Path | None,
) -> None:
    """Passes and TTFT of a long semantic hit, chunked at ``--chunk`` and unchunked."""
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

    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    window = model_context_length(model) or tokens
    length = fitting_length(tokens, window, GREEDY_TOKENS)
    workload = build_workload("cross_instruction", tok, essay_texts(), length, groups, 11)
    env = parse_semblend_env(list(env_values))
    logs = Path("bench-results") / "chunked-long-hit"
    # SGLang's CPU memory rule leaves nothing for KV with chunked prefill off unless the fraction
    # is given (tests/test_e2e_server_options.py); both servers get the same pool
    pool = ["--mem-fraction-static", "0.8", "--max-total-tokens", "32768"]
    setups = {
        "chunked": ["--chunked-prefill-size", str(chunk), *pool],
        "unchunked": ["--chunked-prefill-size", "-1", *pool],
    }
    servers = {}
    try:
        for name, flags in setups.items():
            servers[name] = start_servers(["exact_spans"], model, flags, logs / name, env)[
                "exact_spans"
            ]
        clients = {name: ServerClient(srv.url) for name, srv in servers.items()}
        for client in clients.values():
            client.generate(workload.groups[0].probes[0].prompt_ids[:64], 1)
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
        for r in range(repeats):
            for group in workload.groups:
                probe = group.probes[0].prompt_ids
                order = list(setups) if r % 2 == 0 else list(reversed(setups))
                for name in order:
                    client, log = clients[name], logs / name / "e2e-exact_spans-server.log"
                    client.flush()
                    for donor in group.donors:
                        client.generate(donor.prompt_ids, 1)
                    before, passes = client.snapshot(), _passes(log)
                    answer = client.generate(probe, 1)
                    after = client.snapshot()
                    outcome, reused = outcome_delta(before, after)
                    rows[name].append(
                        {
                            "ttft_ms": 1000 * answer.ttft_s,
                            "passes": _passes(log) - passes,
                            "prompt": len(probe),
                            "computed": len(probe) - reused,
                            "outcome": outcome,
                        }
                    )
    finally:
        for srv in servers.values():
            srv.stop()
    ratios = [
        c["ttft_ms"] / u["ttft_ms"] for c, u in zip(rows["chunked"], rows["unchunked"], strict=True)
    ]
    for name, got in rows.items():
        ttft = [x["ttft_ms"] for x in got]
        click.echo(
            f"{name:9s} TTFT p50 {statistics.median(ttft):8.0f} ms (min {min(ttft):.0f}, max "
            f"{max(ttft):.0f})  passes {[x['passes'] for x in got]}  computed "
            f"{[x['computed'] for x in got]} of {got[0]['prompt']}  {got[0]['outcome']}"
        )
    click.echo(
        f"chunked/unchunked TTFT: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}, n={len(ratios)})"
    )
    if json_path is not None:
        report = {
            "environment": environment(model=model),
            "tokens": length,
            "chunk": chunk,
            "semblend_env": env,
            "rows": rows,
            "ratios": ratios,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
