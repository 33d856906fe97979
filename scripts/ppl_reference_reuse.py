"""What the bench's PPL reference request reuses on a semblend server (issue 32's finding).

Usage: ``python scripts/ppl_reference_reuse.py MIN_DEVIATION CONTEXT_TOKENS`` (e.g. ``1e-4
2048``). Starts one exact_spans server of SmolLM2 with ``SEMBLEND_RECOMPUTE_MIN_DEVIATION``, and
for 3 ``qa_rag`` groups sends what ``bench e2e`` sends (the group's donors, the probe, then the
reference request: prompt + gold answer, teacher-forced) and prints the outcome, reused and
recomputed tokens each of the last two added, and the reference's summed logprob beside a cold
one (after a flush). Measurement only; nothing imports it.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(min_deviation: str, context_tokens: int) -> None:
    """Run the groups on one started server and print what each request added."""
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoTokenizer

    from semblend_sglang.bench.builtin_workloads import build_workload
    from semblend_sglang.bench.client import ServerClient
    from semblend_sglang.bench.snapshot_deltas import counter_delta, outcome_delta
    from semblend_sglang.bench.systems import start_servers
    from semblend_sglang.data import essay_texts
    from semblend_sglang.model_prep import prepare_model

    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    workload = build_workload("qa_rag", tok, essay_texts(), context_tokens, 3, 0)
    env = {"SEMBLEND_RECOMPUTE_MIN_DEVIATION": min_deviation}
    logs = Path("bench-results")
    logs.mkdir(exist_ok=True)
    servers = start_servers(["exact_spans"], model, [], logs, env)
    try:
        client = ServerClient(servers["exact_spans"].url)
        for group in workload.groups:
            probe = group.probes[0]
            client.flush()
            for donor in group.donors:
                client.generate(donor.prompt_ids, 1)
            s0 = client.snapshot()
            client.generate(probe.prompt_ids, 1)
            s1 = client.snapshot()
            after = client.reference_logprobs(probe.prompt_ids, probe.reference_ids)
            s2 = client.snapshot()
            client.flush()
            cold = client.reference_logprobs(probe.prompt_ids, probe.reference_ids)
            for name, a, b in (("probe", s0, s1), ("reference", s1, s2)):
                outcome, reused = outcome_delta(a, b)
                recomputed = counter_delta(a, b, "recomputed_tokens")
                print(
                    f"{group.group_id} {name}: {outcome}, reused {reused}, recomputed {recomputed}"
                )
            print(f"  reference logprob sum {sum(after):.3f}, cold {sum(cold):.3f}")
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
