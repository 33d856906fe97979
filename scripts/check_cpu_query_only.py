"""Serve the prepared SmolLM2 on CPU (vanilla: SEMBLEND_ENABLED=0) with the query-only extend on
or off; print greedy tokens and logprobs of a cold request and of its exact repeat, and the
exact hit's TTFT (max_new_tokens=1, 3 runs). One JSON line.

    .venv/bin/python scripts/check_cpu_query_only.py on|off [--tokens 1500]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from semblend_sglang.cpu_runtime import ensure_torchvision_importable
from semblend_sglang.data import essay_texts
from semblend_sglang.model_prep import prepare_model
from semblend_sglang.server import ServerSpec, http_json, start_healthy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("on", "off"))
    parser.add_argument("--tokens", type=int, default=1500)
    args = parser.parse_args()
    ensure_torchvision_importable()
    from transformers import AutoTokenizer

    model = prepare_model()
    ids = AutoTokenizer.from_pretrained(model)(essay_texts()[3])["input_ids"][: args.tokens]
    env = {"SEMBLEND_ENABLED": "0"}
    if args.mode == "off":
        env["SEMBLEND_CPU_QUERY_ONLY_EXTEND"] = "0"
    log = Path(f".cache/check_cpu_query_only_{args.mode}.log")
    (srv,) = start_healthy([ServerSpec(model, env=env, log_path=log)], timeout=900)
    try:

        def generate(n: int) -> tuple[dict[str, Any], float]:
            t0 = time.perf_counter()
            params = {"temperature": 0, "max_new_tokens": n}
            payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
            return http_json(srv.url + "/generate", payload), (time.perf_counter() - t0) * 1e3

        out: dict[str, Any] = {"mode": args.mode}
        for name in ("cold", "hit"):
            answer, _ = generate(8)
            meta = answer["meta_info"]
            out[f"{name}_tokens"] = [t for _, t, _ in meta["output_token_logprobs"]]
            out[f"{name}_logprobs"] = [lp for lp, _, _ in meta["output_token_logprobs"]]
            out[f"{name}_cached"] = meta.get("cached_tokens")
        out["hit_ttft_ms"] = [round(generate(1)[1], 1) for _ in range(3)]
        print(json.dumps(out))
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
