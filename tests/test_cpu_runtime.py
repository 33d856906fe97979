"""The CPU runtime: the sgl_kernel stand-in and the torchvision shim, in this process and in
processes started with the spawn method (how SGLang starts its scheduler and detokenizer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from semblend_sglang.cpu_runtime import SITE_DIR, runtime_environ


def _run_child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_runtime_environ_puts_site_dir_first_and_selects_cpu_engine() -> None:
    env = runtime_environ({"PYTHONPATH": "/somewhere/else", "PATH": os.environ["PATH"]})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/somewhere/else"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    # Applying twice does not stack the folder.
    again = runtime_environ(env)
    assert again["PYTHONPATH"].split(os.pathsep).count(str(SITE_DIR)) == 1


def test_without_runtime_torchvision_import_fails_under_cpu_torch() -> None:
    """The shim is needed: PyPI's torchvision cannot be imported with CPU torch on its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    result = _run_child("import torchvision", env)
    assert result.returncode != 0
    assert "torchvision::nms does not exist" in result.stderr


def test_spawned_child_gets_shim_and_standin(tmp_path: Path) -> None:
    """A fresh interpreter with the runtime environment imports torchvision and resolves
    sgl_kernel to the stand-in, through sitecustomize alone (nothing imported by hand)."""
    log = tmp_path / "standin.log"
    env = runtime_environ()
    env["SEMBLEND_SGL_KERNEL_STANDIN_LOG"] = str(log)
    code = (
        "import multiprocessing as mp\n"
        "def child(q):\n"
        "    import torchvision, sgl_kernel\n"
        "    from sgl_kernel import assign_req_to_token_pool_cpu\n"
        "    q.put((sgl_kernel.IS_SEMBLEND_STANDIN, torchvision.__version__))\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn')\n"
        "    q = ctx.Queue()\n"
        "    p = ctx.Process(target=child, args=(q,))\n"
        "    p.start(); print(q.get(timeout=240)); p.join(60)\n"
        "    raise SystemExit(p.exitcode)\n"
    )
    script = tmp_path / "spawn_child.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(True, '0.28.0" in result.stdout
    lines = log.read_text().splitlines()
    assert any(line.endswith(" import") for line in lines)
    assert not any(" call " in line for line in lines)


def test_standin_call_records_and_raises(tmp_path: Path) -> None:
    log = tmp_path / "standin.log"
    env = runtime_environ()
    env["SEMBLEND_SGL_KERNEL_STANDIN_LOG"] = str(log)
    result = _run_child(
        "from sgl_kernel import copy_all_layer_kv_cache_cpu\ncopy_all_layer_kv_cache_cpu(1, 2)",
        env,
    )
    assert result.returncode != 0
    assert "import-only CPU stand-in" in result.stderr
    assert any(
        line.endswith(" call copy_all_layer_kv_cache_cpu") for line in log.read_text().splitlines()
    )


@pytest.mark.parametrize(
    "statement", ["from sgl_kernel import fused_add_rmsnorm", "import sgl_kernel.ops"]
)
def test_standin_refuses_non_cpu_names(statement: str) -> None:
    result = _run_child(statement, runtime_environ())
    assert result.returncode != 0
    assert "ImportError" in result.stderr or "ModuleNotFoundError" in result.stderr
