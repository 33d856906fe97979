"""``bench blend-sim`` (bench/blend_sim.py): its float32 forward against
transformers' on the real SmolLM2 weights and real text (and on a random Qwen2 model with q/k/v
biases), and its recompute simulation against the cold prefill it must equal when nothing or
everything is recomputed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from semblend_sglang import recompute
from semblend_sglang.bench.blend_sim import (
    LlamaReference,
    blended_prefill,
    command,
    simulate_group,
    windowed,
)
from semblend_sglang.bench.builtin_workloads import build_workload
from semblend_sglang.data import essay_texts
from semblend_sglang.kernels.rotate_ref import rotate_fp32
from tests.harness.random_models import SHAPES, build_random_model


@pytest.fixture(scope="module")
def model(smollm2_model_dir: Path) -> LlamaReference:
    return LlamaReference(smollm2_model_dir)


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer: Any) -> list[int]:
    ids = smollm2_tokenizer(essay_texts()[0], add_special_tokens=False)["input_ids"]
    return list(ids[:48])


def _transformers_model(folder: Path) -> Any:
    """transformers' own float32 model of ``folder``: the reference the forward must equal."""
    from semblend_sglang.cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _assert_logits_match(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.allclose(got, expected, atol=2e-3, rtol=1e-4), (got - expected).abs().max()


def test_forward_and_greedy_match_transformers(
    model: LlamaReference, prompt: list[int], smollm2_model_dir: Path
) -> None:
    hf = _transformers_model(smollm2_model_dir)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
        generated = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=2
        )[0, len(prompt) :].tolist()
    cold = model.prefill(prompt)
    _assert_logits_match(model.logits(cold.hidden[-1]), expected)
    tokens, margins = model.greedy(cold.keys, cold.values, cold.hidden[-1][-1], 8)
    assert tokens == generated
    top = expected[-1].topk(2).values
    assert margins[0] == pytest.approx(float(top[0] - top[1]), abs=2e-3)
    assert all(m >= 0 for m in margins)


def test_blended_prefill_is_cold_when_the_kept_kv_is_the_prompts_own(
    model: LlamaReference, prompt: list[int]
) -> None:
    cold = model.prefill(prompt)
    kept = torch.arange(4, 30)
    for check in (-1, 0, 1, 5):
        keys, values, last, _ = blended_prefill(model, cold, cold.keys, cold.values, kept, check)
        assert torch.allclose(last, cold.hidden[-1][-1], atol=1e-4)
        for layer in range(model.layers):
            assert torch.allclose(keys[layer], cold.keys[layer], atol=1e-4)
            assert torch.allclose(values[layer], cold.values[layer], atol=1e-4)


def test_blended_prefill_with_another_donor_changes_only_the_layers_after_the_check(
    model: LlamaReference, prompt: list[int]
) -> None:
    cold = model.prefill(prompt)
    other = model.prefill(prompt[::-1])  # real token values, another context for every row
    kept = torch.arange(10, 20)
    check = 3
    keys, _, last, _ = blended_prefill(model, cold, other.keys, other.values, kept, check)
    for layer in range(check + 1):
        assert torch.equal(keys[layer], cold.keys[layer])  # computed densely up to the check
    for layer in range(check + 1, model.layers):
        assert torch.equal(keys[layer][kept], other.keys[layer][kept])
    assert not torch.allclose(last, cold.hidden[-1][-1], atol=1e-3)


def test_blended_prefill_adds_up_what_the_tail_attends_to(
    model: LlamaReference, prompt: list[int]
) -> None:
    """The watched tail's attention: a softmax row per layer sums to 1, so the total over every
    position is the number of layers run; nothing after the tail's last row is attended; the
    watched rows are the last computed ones, so the first layer's total equals that layer's
    attention computed by hand from the cold K."""
    cold = model.prefill(prompt)
    n = len(prompt)
    kept = torch.arange(5, 15)
    check = 2
    *_, paid = blended_prefill(model, cold, cold.keys, cold.values, kept, check, watch_tail=4)
    assert paid.shape == (n,)
    assert float(paid.sum()) == pytest.approx(model.layers - check - 1, abs=1e-4)
    assert bool((paid >= 0).all()) and float(paid[kept].sum()) > 0
    *_, one_layer = blended_prefill(
        model, cold, cold.keys, cold.values, kept, model.layers - 2, watch_tail=1
    )
    layer = model.layers - 1
    x = model._norm(cold.hidden[layer][-1:], f"model.layers.{layer}.input_layernorm.weight")
    q = model._proj(x, f"model.layers.{layer}.self_attn.q_proj").view(1, model.heads, -1)
    q = rotate_fp32(q, torch.tensor([n - 1]), model.rope)
    k = cold.keys[layer].repeat_interleave(model.heads // model.kv_heads, 1)
    by_hand = torch.einsum("qhd,khd->hk", q, k).div(model.head_dim**0.5).softmax(-1).mean(0)
    assert torch.allclose(one_layer, by_hand, atol=1e-5)


def test_qwen2_with_qkv_biases_matches_transformers(
    prompt: list[int], smollm2_model_dir: Path
) -> None:
    folder = build_random_model(SHAPES["qwen2_theta1e6"], smollm2_model_dir)
    reference = LlamaReference(folder)
    assert "model.layers.0.self_attn.q_proj.bias" in reference.w  # the biases are exercised
    with torch.no_grad():
        expected = _transformers_model(folder)(torch.tensor([prompt])).logits[0]
    _assert_logits_match(reference.logits(reference.prefill(prompt).hidden[-1]), expected)


def test_simulate_group_recomputing_everything_is_cold(
    model: LlamaReference, smollm2_tokenizer: Any
) -> None:
    workload = build_workload("rag", smollm2_tokenizer, essay_texts(), 256, 1, 0)
    (group,) = workload.groups
    probe = group.probes[0].prompt_ids
    donors = [d.prompt_ids for d in group.donors]
    margins, results = simulate_group(
        model, probe, donors, group.shared_spans, ratios=[1.0, 0.0], check_layers=[2]
    )
    _, some = simulate_group(model, probe, donors, group.shared_spans, [0.0], [2], ["window"])
    assert some == [("window@2", 0.0, next(a for n, r, a in results if n == "window@2" and r == 0))]
    assert len(margins) == 32 and all(m >= 0 for m in margins)
    assert [(name, ratio) for name, ratio, _ in results] == [
        ("deviation@2", 1.0),
        ("deviation@2", 0.0),
        ("deep@2", 1.0),
        ("deep@2", 0.0),
        ("question@2", 1.0),
        ("question@2", 0.0),
        ("window@2", 1.0),
        ("window@2", 0.0),
        ("question", 1.0),
        ("question", 0.0),
        ("staged@2", 1.0),
        ("staged@2", 0.0),
    ]
    assert all(agree == 1.0 for _, ratio, agree in results if ratio == 1.0)
    after_check = ("deviation@2", "deep@2", "question@2")
    zero = {agree for name, ratio, agree in results if ratio == 0.0 and name in after_check}
    assert len(zero) == 1  # nothing recomputed after the same check: the selection cannot matter
    with pytest.raises(ValueError, match="missing"):
        simulate_group(model, probe, donors, [(7, 7, 7, 7)], ratios=[0.5], check_layers=[1])
    with pytest.raises(ValueError, match="check layers"):
        simulate_group(model, probe, donors, group.shared_spans, [0.5], [model.layers])


def test_reference_refuses_what_it_does_not_model(tmp_path: Path, smollm2_model_dir: Path) -> None:
    import json

    config = json.loads((smollm2_model_dir / "config.json").read_text())
    for change, message in (
        ({"architectures": ["Olmo2ForCausalLM"]}, "not one of"),
        ({"mlp_bias": True}, "MLP biases are not modelled"),
        ({"use_sliding_window": True}, "sliding window is not modelled"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            LlamaReference(tmp_path)


@pytest.mark.parametrize(
    ("args", "option", "fragment"),
    [
        (["--ratios", "0.15,high"], "--ratios", "'high' is not a ratio"),
        (["--ratios", "1.5"], "--ratios", "'1.5' is not a ratio"),
        (["--check-layers", "1,x"], "--check-layers", "'x' is not a layer of the model"),
        (["--check-layers", "-1"], "--check-layers", "'-1' is not a layer of the model"),
        (["--workloads", "rag,control"], "--workloads", "not a workload with donors: ['control']"),
        (["--lengths", "12"], "--lengths", "'12' is not a context length"),
        (["--groups", "0"], "--groups", "0 is not in the range"),
        (["--groups", "3", "--only", "1,3"], "--only", "'3' is not a group index (0 to 2)"),
        (["--only", "first"], "--only", "'first' is not a group index (0 to 1)"),
        (["--selections", "deep,oracle"], "--selections", "'oracle' is not one of deviation"),
    ],
)
def test_a_malformed_flag_is_one_usage_error_naming_it(
    args: list[str], option: str, fragment: str, smollm2_model_dir: Path
) -> None:
    result = CliRunner().invoke(command, [*args, "--model-path", str(smollm2_model_dir)])
    assert result.exit_code == 2, result.output
    assert option in result.output and fragment in result.output, result.output
    assert "Traceback" not in result.output and "| workload |" not in result.output


def test_a_check_layer_beyond_the_model_is_a_usage_error(smollm2_model_dir: Path) -> None:
    import json

    depth = json.loads((smollm2_model_dir / "config.json").read_text())["num_hidden_layers"]
    args = ["--check-layers", f"1,{depth}", "--model-path", str(smollm2_model_dir)]
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2, result.output
    assert f"'{depth}' is not a layer of the model (0 to {depth - 1})" in result.output
    assert "--check-layers" in result.output and "| workload |" not in result.output


def test_only_simulates_the_groups_named_with_every_selection(
    smollm2_model_dir: Path, tmp_path: Path
) -> None:
    """``--only 1`` of three groups: the rows of group 1 only, one per selection (a random Qwen2,
    so only the table's shape is asserted)."""
    folder = build_random_model(SHAPES["qwen2_theta1e6"], smollm2_model_dir, tmp_path)
    args = ["--workloads", "rag", "--lengths", "256", "--groups", "3", "--only", "1"]
    args += ["--ratios", "0.5", "--check-layers", "1", "--model-path", str(folder)]
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 0, result.output
    rows = [line.split(" | ") for line in result.output.splitlines() if "| rag |" in line]
    assert {row[2] for row in rows} == {"rag-256-001"}, result.output
    expected = ["deviation@1", "deep@1", "question@1", "window@1", "question"]
    assert [row[4] for row in rows] == expected


def test_windowed_ranks_whole_windows_by_their_sampled_position() -> None:
    score = torch.tensor([0.1, 9.0, 9.0, 0.5, 0.2, 0.0, 0.3])
    assert windowed(score, 3).tolist() == pytest.approx([0.1] * 3 + [0.5] * 3 + [0.3])
    assert recompute.top(windowed(score, 3), 4).tolist() == [3, 4, 5, 6]
