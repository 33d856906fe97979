"""Tile sweep of the Triton transfer kernel on a CUDA GPU (docs/perf.md, "Kernels", "GPU").

For each shape and dtype: the plain copy of the same bytes (``index_select`` + ``index_copy_``
per layer, the copy bound), the kernel as shipped, the kernel at every
(``TILE_ELEMENTS``, ``TILE_WARPS``) of the sweep, and, when ``--baseline FILE`` names another
version of ``kernels/transfer_triton.py``, that version: all timed interleaved in one process
(one call of each per round after warm-up, median of ``--rounds``), slot checks off
(``validate=False``: the kernel alone). Every variant's output is compared with the torch
reference first.

    python scripts/gpu_transfer_tiles.py [--baseline OLD.py] [--json OUT]
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

from semblend_sglang.bench.kernel_bandwidth import random_pool, time_interleaved
from semblend_sglang.kernels import RopeSpec, transfer_kv_sglang
from semblend_sglang.kernels import transfer_triton as shipped
from semblend_sglang.kernels.kv_layouts import block_caches, sglang_views

SHAPES = {  # layers, KV heads, head dim, tokens moved
    "8B-like 32x8x128 4096": (32, 8, 128, 4096),
    "SmolLM2 30x3x64 2048": (30, 3, 64, 2048),
    "Qwen2.5-1.5B 28x2x128 4096": (28, 2, 128, 4096),
}
TILES = [(e, w) for e, w in itertools.product((2048, 4096, 8192, 16384), (2, 4, 8))]


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("transfer_triton_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(
    shape_name: str, dims: tuple[int, int, int, int], dtype: torch.dtype, old: Any, rounds: int
) -> dict[str, Any]:
    """GB/s of every variant on one shape and dtype, each checked against the reference."""
    dev = torch.device("cuda")
    layers, heads, dim, tokens = dims
    shipped_tile = (shipped.TILE_ELEMENTS, shipped.TILE_WARPS)
    k, v, src, dst = random_pool(dtype, layers, heads, dim, tokens, dev)
    gen = torch.Generator().manual_seed(1)
    deltas = torch.randint(-3000, 3000, (tokens,), generator=gen).to(dev)
    spec = RopeSpec(head_dim=dim, rotary_dim=dim, rope_theta=500000.0)
    k4, v4 = sglang_views(k, v)
    caches = block_caches(k4, v4, spec, None, None)
    moved = 2 * 2 * layers * tokens * heads * dim * torch.finfo(dtype).bits // 8

    kk, vv = [t.clone() for t in k], [t.clone() for t in v]
    transfer_kv_sglang(kk, vv, src, dst, deltas, spec, backend="torch", validate=False)
    want = [t[dst] for t in (*kk, *vv)]
    del kk, vv

    def kernel(tile: tuple[int, int] | None, module: Any = shipped) -> Callable[[], None]:
        def run() -> None:
            if tile is not None:
                shipped.TILE_ELEMENTS, shipped.TILE_WARPS = tile
            module.transfer_kv_blocks_triton(caches, src, dst, deltas, spec)

        return run

    def copy() -> None:
        for buf in (*k, *v):
            buf.index_copy_(0, dst, buf.index_select(0, src))

    fns: dict[str, Callable[[], None]] = {"copy": copy}
    fns[f"shipped {shipped_tile}"] = kernel(shipped_tile)
    for tile in TILES:
        fns[f"tile {tile}"] = kernel(tile)
    if old is not None:
        fns["baseline"] = kernel(None, old)
    tol = 8 * torch.finfo(dtype).eps  # values are N(0, 1): |x| < 8 here
    for name, fn in fns.items():
        if name == "copy":
            continue
        for t in (*k, *v):
            t[dst] = 0
        fn()
        got = [t[dst] for t in (*k, *v)]
        ok = all(
            torch.allclose(g.float(), w.float(), atol=8 * tol, rtol=tol)
            for g, w in zip(got, want, strict=True)
        )
        assert ok, f"{name} differs from the reference on {shape_name} {dtype}"
    seconds = time_interleaved(fns, dev, rounds)
    shipped.TILE_ELEMENTS, shipped.TILE_WARPS = shipped_tile
    return {
        "shape": shape_name,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": moved,
        "gbps": {name: moved / t / 1e9 for name, t in seconds.items()},
    }


@click.command()
@click.option("--baseline", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--rounds", default=20, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(baseline: Path | None, rounds: int, json_path: Path | None) -> None:
    """Print and optionally write GB/s per variant, shape and dtype."""
    old = _load(baseline) if baseline is not None else None
    shipped_name = f"shipped {(shipped.TILE_ELEMENTS, shipped.TILE_WARPS)}"
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "results": []}
    for (shape_name, dims), dtype in itertools.product(
        SHAPES.items(), (torch.float16, torch.bfloat16)
    ):
        row = measure(shape_name, dims, dtype, old, rounds)
        out["results"].append(row)
        gbps = row["gbps"]
        best = max((n for n in gbps if n != "copy"), key=lambda n: gbps[n])
        click.echo(
            f"{shape_name:28s} {row['dtype']:9s} copy {gbps['copy']:7.1f} GB/s  "
            f"shipped {gbps[shipped_name]:7.1f}  "
            + (f"baseline {gbps['baseline']:7.1f}  " if old is not None else "")
            + f"best {best} {gbps[best]:7.1f}"
        )
    for name in [shipped_name, *(f"tile {t}" for t in TILES), "baseline"]:
        per = [r["gbps"].get(name) for r in out["results"]]
        if all(p is not None for p in per):
            ratios = [p / r["gbps"]["copy"] for p, r in zip(per, out["results"], strict=True)]
            click.echo(
                f"{name:24s} ratio to copy: min {min(ratios):.2f} "
                f"median {statistics.median(ratios):.2f}  ({', '.join(f'{x:.2f}' for x in ratios)})"
            )
    if json_path is not None:
        json_path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
