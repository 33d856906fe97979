"""``python -m semblend_sglang.bench kernels``: transfer_kv bandwidth against a plain copy.

For an SGLang-layout pool (per layer [slots, kv_heads, head_dim] K and V), moves ``tokens``
donor slots to as many recipient slots in every layer: once with ``transfer_kv_sglang`` (gather,
rotate K, scatter; slot checks included) and once with a plain torch copy of the same bytes
(``index_select`` + ``index_copy_`` of K and V per layer), the copy bound. Bytes moved = bytes
read + bytes written for K and V of all layers. On CUDA the Triton kernel runs; on CPU the torch
reference does, and the output says so.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import click
import torch

from semblend_sglang.kernels import RopeSpec, transfer_kv_sglang

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], None], device: torch.device, iters: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} torch threads)"


def run_one(
    dtype: torch.dtype,
    layers: int,
    heads: int,
    head_dim: int,
    tokens: int,
    iters: int,
    device: torch.device,
) -> dict[str, float]:
    """Time transfer_kv_sglang and the plain copy for one dtype; returns the figures."""
    slots = 2 * tokens + 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    k_bufs = [
        torch.randn(slots, heads, head_dim, generator=gen).to(device, dtype) for _ in range(layers)
    ]
    v_bufs = [
        torch.randn(slots, heads, head_dim, generator=gen).to(device, dtype) for _ in range(layers)
    ]
    perm = torch.randperm(slots - 1, generator=gen) + 1
    src = perm[:tokens].sort().values.to(device)
    dst = perm[tokens : 2 * tokens].sort().values.to(device)
    deltas = torch.full((tokens,), 1234, dtype=torch.int64, device=device)
    spec = RopeSpec(head_dim=head_dim, rotary_dim=head_dim, rope_theta=500000.0)

    def transfer() -> None:
        transfer_kv_sglang(k_bufs, v_bufs, src, dst, deltas, spec)

    def transfer_unchecked() -> None:
        transfer_kv_sglang(k_bufs, v_bufs, src, dst, deltas, spec, validate=False)

    def copy() -> None:
        for buf in (*k_bufs, *v_bufs):
            buf.index_copy_(0, dst, buf.index_select(0, src))

    moved = 2 * 2 * layers * tokens * heads * head_dim * torch.finfo(dtype).bits // 8
    t_transfer = _time(transfer, device, iters)
    t_unchecked = _time(transfer_unchecked, device, iters)
    t_copy = _time(copy, device, iters)
    return {
        "bytes_moved": float(moved),
        "transfer_s": t_transfer,
        "transfer_unchecked_s": t_unchecked,
        "copy_s": t_copy,
        "transfer_gbps": moved / t_transfer / 1e9,
        "transfer_unchecked_gbps": moved / t_unchecked / 1e9,
        "copy_gbps": moved / t_copy / 1e9,
        "ratio": t_copy / t_transfer,
    }


@click.command(name="kernels")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the results as JSON to this file.",
)
@click.option("--layers", default=32, show_default=True)
@click.option("--kv-heads", "heads", default=8, show_default=True)
@click.option("--head-dim", default=128, show_default=True)
@click.option("--tokens", default=4096, show_default=True)
@click.option(
    "--iters",
    default=None,
    type=int,
    help="Timed calls per figure (default: 20 on CUDA, 3 on CPU); the median is reported.",
)
@click.option("--device", default=None, help="torch device (default: cuda if available, else cpu).")
def command(
    json_path: str | None,
    layers: int,
    heads: int,
    head_dim: int,
    tokens: int,
    iters: int | None,
    device: str | None,
) -> None:
    """Bytes moved per second by transfer_kv_sglang and by a plain torch copy (the copy bound)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n_iters = iters or (20 if dev.type == "cuda" else 3)
    path = "triton kernel" if dev.type == "cuda" else "torch reference (CPU; no Triton)"
    results: dict[str, Any] = {
        "job": "kernels",
        "date": date.today().isoformat(),
        "device": _device_name(dev),
        "transfer_path": path,
        "shape": {"layers": layers, "kv_heads": heads, "head_dim": head_dim, "tokens": tokens},
        "iters": n_iters,
        "dtypes": {},
    }
    click.echo(f"transfer_kv vs plain copy on {results['device']}: transfer_kv runs the {path}")
    click.echo(f"{layers} layers x {heads} KV heads x {head_dim} dims x {tokens} tokens, K and V")
    click.echo(
        f"{'dtype':<10}{'MB moved':>10}{'transfer GB/s':>15}{'unchecked GB/s':>16}"
        f"{'copy GB/s':>11}{'ratio':>7}"
    )
    for name, dtype in DTYPES.items():
        r = run_one(dtype, layers, heads, head_dim, tokens, n_iters, dev)
        results["dtypes"][name] = r
        click.echo(
            f"{name:<10}{r['bytes_moved'] / 1e6:>10.0f}{r['transfer_gbps']:>15.2f}"
            f"{r['transfer_unchecked_gbps']:>16.2f}{r['copy_gbps']:>11.2f}{r['ratio']:>7.2f}"
        )
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
