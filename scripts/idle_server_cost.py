"""Does the SGLang server the bench is not asking take CPU from the one it is measuring?
(docs/perf-archive.md, "Two servers on two cores")

The e2e bench runs its systems side by side, one server each, interleaved per probe: while
server A (vanilla) answers, server B (semblend exact_spans) has either been idle for a while or
has just answered the same probe's requests. This script measures A's cold TTFT in those cases,
paired per prompt:

- ``alone``: B not started;
- ``b_idle``: B started and idle for ``--settle-s`` seconds before A's request;
- ``b_just_served``: B answered a request (half the prompt, one token) right before A's;
- ``alone_again``: after B stopped.

``b_idle`` and ``b_just_served`` alternate per prompt (which goes first alternates too), for
``--rounds`` rounds, so drift hits both alike; the summary gives their per-prompt paired ratio.
It also reads B's own CPU (its process tree, in cores) over an idle stretch and over the second
right after it answered. Prompts are flushed from A's cache before each request.

    .venv/bin/python scripts/idle_server_cost.py [--tokens 1024] [--requests 6] [--rounds 2]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click


@click.command()
@click.option("--tokens", default=1024, show_default=True, help="Prompt length of A's requests.")
@click.option("--requests", "n", default=6, show_default=True, help="Prompts per phase.")
@click.option("--rounds", default=2, show_default=True, help="Rounds of the paired phases.")
@click.option("--settle-s", default=3.0, show_default=True, help="B's idle time before b_idle.")
@click.option("--idle-s", default=20.0, show_default=True, help="Idle stretch read on B.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(
    tokens: int, n: int, rounds: int, settle_s: float, idle_s: float, json_path: Path | None
) -> None:
    """Cold TTFT of server A alone, beside an idle B and right after B answered, paired."""
    from transformers import AutoTokenizer

    from semblend_sglang.bench.client import ServerClient
    from semblend_sglang.bench.machine_load import LoadMeter
    from semblend_sglang.bench.report import environment
    from semblend_sglang.bench.systems import start_servers
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable
    from semblend_sglang.data import essay_texts
    from semblend_sglang.model_prep import prepare_model

    ensure_torchvision_importable()
    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    essays = [e for e in essay_texts() if len(tok.encode(e, add_special_tokens=False)) >= tokens]
    prompts = [tok.encode(essays[i], add_special_tokens=False)[:tokens] for i in range(n)]
    logs = Path("bench-results")

    def cold_ms(a: ServerClient, ids: list[int], before: ServerClient | None = None) -> float:
        """A's TTFT of ``ids`` from a flushed cache; ``before`` answers half of it first."""
        a.flush()
        if before is not None:
            before.generate(ids[: tokens // 2], 1)
        return 1000 * a.generate(ids, 1).ttft_s

    def b_cores(meter: LoadMeter, seconds: float) -> float:
        start = meter.sample()
        time.sleep(seconds)
        end = meter.sample()
        return (end.own_s - start.own_s) / (end.wall_s - start.wall_s)

    result: dict[str, object] = {"environment": environment(model=model), "tokens": tokens}
    paired: dict[str, list[list[float]]] = {"b_idle": [], "b_just_served": []}
    servers = start_servers(["vanilla"], model, [], logs)
    a_srv = servers["vanilla"]
    try:
        a = ServerClient(a_srv.url)
        a.generate(prompts[0][:64], 1)  # first-request costs
        result["alone"] = [cold_ms(a, ids) for ids in prompts]
        b_srv = start_servers(["exact_spans"], model, [], logs)["exact_spans"]
        try:
            b = ServerClient(b_srv.url)
            b.generate(prompts[0][:64], 1)
            meter = LoadMeter([b_srv.process.pid])
            time.sleep(2.0)
            result["b_idle_cores"] = b_cores(meter, idle_s)
            b.flush()
            b.generate(prompts[0][: tokens // 2], 1)
            result["b_cores_first_second_after_answer"] = b_cores(meter, 1.0)
            for r in range(rounds):
                row_idle, row_served = [], []
                for i, ids in enumerate(prompts):
                    for case in ("idle", "served") if (i + r) % 2 == 0 else ("served", "idle"):
                        b.flush()
                        if case == "idle":
                            time.sleep(settle_s)
                            row_idle.append(cold_ms(a, ids))
                        else:
                            row_served.append(cold_ms(a, ids, before=b))
                paired["b_idle"].append(row_idle)
                paired["b_just_served"].append(row_served)
        finally:
            b_srv.stop()
        result["alone_again"] = [cold_ms(a, ids) for ids in prompts]
    finally:
        a_srv.stop()
    result.update(paired)
    ratios = [
        s / i
        for rs, ri in zip(paired["b_just_served"], paired["b_idle"], strict=True)
        for s, i in zip(rs, ri, strict=True)
    ]
    result["just_served_over_idle"] = ratios
    phases: dict[str, object] = {
        "alone": result["alone"],
        "alone_again": result["alone_again"],
        **{phase: [v for row in rows for v in row] for phase, rows in paired.items()},
    }
    for phase, values in phases.items():
        assert isinstance(values, list)
        click.echo(
            f"{phase:14s} median {statistics.median(values):7.0f} ms  "
            f"range {min(values):6.0f}-{max(values):6.0f}  ({len(values)} requests)"
        )
    click.echo(
        f"b_just_served / b_idle, paired per prompt: median {statistics.median(ratios):.3f} "
        f"range {min(ratios):.3f}-{max(ratios):.3f} ({len(ratios)} pairs)"
    )
    click.echo(f"B idle: {result['b_idle_cores']:.4f} cores over {idle_s:.0f} s")
    click.echo(
        f"B in the second after it answered: {result['b_cores_first_second_after_answer']:.3f}"
        " cores"
    )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
