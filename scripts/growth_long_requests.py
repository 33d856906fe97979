"""What semblend's state holds after many long requests (docs/perf-archive.md, "Long prompts:
4,096 and 8,192 tokens").

Drives ``--requests`` requests of the built-in workloads at ``--tokens`` (cross_instruction,
rag, rag_corpus, template, 2 groups each: each group's donors, then its probes, each run to its
end; the cycle repeats in a new namespace, ``extra_key``, as another tenant would send it)
through the cache harness: SGLang 0.5.23's real ``UnifiedRadixCache``, ``ReqToTokenPool``,
``MHATokenToKVPool`` (2 layers) and allocator, the scheduler's admission and chunking, with the
semblend adapter installed and the deterministic KV model for the forward (tests/harness). Every
``--every`` requests it records: the donor index (donors, live postings, the bytes it accounts),
the held-donor store (entries, held slots, bytes of its slot tensors), requests semblend still
tracks, and this process's resident memory. The pool is SGLang's CPU default (65,536 tokens).

    .venv/bin/python scripts/growth_long_requests.py [--tokens 8192] [--requests 1000]
        [--every 100] [--json FILE]
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("cross_instruction", "rag", "rag_corpus", "template")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@click.command()
@click.option("--tokens", default=8192, show_default=True)
@click.option("--requests", "total", default=1000, show_default=True)
@click.option("--every", default=100, show_default=True)
@click.option("--pool-tokens", default=65536, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(tokens: int, total: int, every: int, pool_tokens: int, json_path: Path | None) -> None:
    """Index, held-donor and process memory after every ``--every`` of ``--requests``."""
    sys.path.insert(0, str(REPO))
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import AutoTokenizer

    from semblend_sglang.bench.builtin_workloads import build_workload, fitting_length
    from semblend_sglang.bench.e2e import model_context_length
    from semblend_sglang.bench.e2e_runner import GREEDY_TOKENS
    from semblend_sglang.config import Config
    from semblend_sglang.data import essay_texts
    from semblend_sglang.model_prep import prepare_model
    from semblend_sglang.patches.sglang.flow.held_donors import held_of
    from tests.harness import HarnessConfig, SglangCacheHarness
    from tests.harness.reuse import installed

    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    length = fitting_length(tokens, model_context_length(model) or tokens, GREEDY_TOKENS)
    essays = essay_texts()
    groups_per = 2  # the essays hold about this much distinct text per workload at 8K
    cycle: list[list[int]] = []
    built = {w: build_workload(w, tok, essays, length, groups_per, 3) for w in WORKLOADS}
    for g in range(groups_per):
        for w in WORKLOADS:
            group = built[w].groups[g]
            cycle += [d.prompt_ids for d in group.donors] + [p.prompt_ids for p in group.probes]
    # each pass over the cycle in its own namespace (extra_key): new donors, no exact hit
    stream = [(cycle[i % len(cycle)], f"tenant-{i // len(cycle)}") for i in range(total)]
    click.echo(f"{len(stream)} requests of {length} tokens (prompts built)", err=True)

    hooks = installed(Config())
    adapter = next(hooks)
    rows: list[dict[str, float]] = []
    started = time.monotonic()
    try:
        model_config = ModelConfig(model_path=model, dtype="float32")
        h = SglangCacheHarness(
            HarnessConfig(
                pool_tokens=pool_tokens,
                max_context_len=length + 512,
                chunked_prefill_size=4096,
                max_prefill_tokens=16384,
            ),
            model_config,
        )
        for i, (prompt, tenant) in enumerate(stream, start=1):
            h.submit(prompt, max_new_tokens=2, extra_key=tenant)
            h.run_until_idle(check=False)
            if i % every == 0 or i == len(stream):
                snap = adapter.runtime.snapshot()
                store = held_of(h.cache)
                held_slots = 0 if store is None else store.held_tokens
                row = {
                    "requests": i,
                    "index_donors": snap["index"]["donors"],
                    "index_live_postings": snap["index"]["live_postings"],
                    "index_bytes": snap["index"].get("bytes", -1),
                    "held_entries": 0 if store is None else len(store),
                    "held_slots": held_slots,
                    "held_slot_tensor_bytes": 8 * held_slots,
                    "tracked_requests": len(adapter.flow.requests),
                    "materialized": snap["outcomes"]["materialized"],
                    "rss_mb": _rss_mb(),
                    "wall_s": time.monotonic() - started,
                }
                rows.append(row)
                click.echo(json.dumps(row))
    finally:
        hooks.close()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    click.echo(f"peak RSS {peak_mb:.0f} MB, {time.monotonic() - started:.0f} s")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"tokens": length, "rows": rows, "peak_mb": peak_mb}))


if __name__ == "__main__":
    main()
