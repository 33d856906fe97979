"""``python -m semblend_sglang.bench kernels``: transfer_kv bandwidth against a plain copy.

For an SGLang-layout pool (per layer [slots, kv_heads, head_dim] K and V), moves ``tokens``
donor slots to as many recipient slots in every layer: with ``transfer_kv_sglang`` (gather,
rotate K, scatter; slot checks included), the same with ``validate=False``, and a plain torch
copy of the same bytes (``index_select`` + ``index_copy_`` of K and V per layer), the copy
bound. Bytes moved = bytes read + bytes written for K and V of all layers. On CUDA the Triton
kernel runs; on CPU the torch fast path (``kernels/transfer_cpu.py``) runs; the torch
reference (``backend="torch"``) is timed beside it on both. The variants are timed interleaved
(one call of each per round, after one warm-up call each), so load changes hit all of them
alike; the median per variant is reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import date
from typing import Any

import click
import torch

from semblend_sglang.kernels import RopeSpec, transfer_kv_sglang

from .metrics import percentile
from .report import cpu_model, write_json

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""The cache dtypes ``--dtypes`` may name."""
DEFAULT_DTYPES = "float16,bfloat16"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], None]], device: torch.device, iters: int
) -> dict[str, float]:
    """Median seconds per call of each function: one warm-up call each, then ``iters`` rounds
    that call every function once, in order."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
        _sync(device)
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: percentile(t, 50) for name, t in times.items()}


def _device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.get_num_threads()} torch threads)"


def random_pool(
    dtype: torch.dtype, layers: int, heads: int, head_dim: int, tokens: int, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """An SGLang-layout pool (per layer [2 * tokens + 1, heads, head_dim] K and V, N(0, 1),
    seed 0) and ``tokens`` sorted source and destination slots, disjoint, slot 0 unused."""
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
    return k_bufs, v_bufs, src, dst


def run_one(
    dtype: torch.dtype,
    layers: int,
    heads: int,
    head_dim: int,
    tokens: int,
    iters: int,
    device: torch.device,
) -> dict[str, float]:
    """Time transfer_kv_sglang, its torch reference and the plain copy for one dtype."""
    k_bufs, v_bufs, src, dst = random_pool(dtype, layers, heads, head_dim, tokens, device)
    deltas = torch.full((tokens,), 1234, dtype=torch.int64, device=device)
    spec = RopeSpec(head_dim=head_dim, rotary_dim=head_dim, rope_theta=500000.0)

    def transfer() -> None:
        transfer_kv_sglang(k_bufs, v_bufs, src, dst, deltas, spec)

    def transfer_unchecked() -> None:
        transfer_kv_sglang(k_bufs, v_bufs, src, dst, deltas, spec, validate=False)

    def reference() -> None:
        transfer_kv_sglang(k_bufs, v_bufs, src, dst, deltas, spec, backend="torch")

    def copy() -> None:
        for buf in (*k_bufs, *v_bufs):
            buf.index_copy_(0, dst, buf.index_select(0, src))

    moved = 2 * 2 * layers * tokens * heads * head_dim * torch.finfo(dtype).bits // 8
    fns = {
        "transfer": transfer,
        "transfer_unchecked": transfer_unchecked,
        "copy": copy,
        "reference": reference,
    }
    seconds = time_interleaved(fns, device, iters)
    out = {"bytes_moved": float(moved)}
    out.update({f"{name}_s": t for name, t in seconds.items()})
    out.update({f"{name}_gbps": moved / t / 1e9 for name, t in seconds.items()})
    out["ratio"] = seconds["copy"] / seconds["transfer"]
    out["speedup_vs_reference"] = seconds["reference"] / seconds["transfer"]
    return out


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
    help="Timed rounds (default: 20 on CUDA, 5 on CPU); the median per variant is reported.",
)
@click.option("--device", default=None, help="torch device (default: cuda if available, else cpu).")
@click.option(
    "--dtypes",
    default=DEFAULT_DTYPES,
    show_default=True,
    help=f"Comma-separated cache dtypes, of {', '.join(DTYPES)} (float32: a CPU server's cache).",
)
def command(
    json_path: str | None,
    layers: int,
    heads: int,
    head_dim: int,
    tokens: int,
    iters: int | None,
    device: str | None,
    dtypes: str,
) -> None:
    """Bytes moved per second by transfer_kv_sglang, by its torch reference and by a plain
    torch copy (the copy bound)."""
    names = [name.strip() for name in dtypes.split(",") if name.strip()]
    unknown = [name for name in names if name not in DTYPES]
    if unknown or not names:
        raise click.BadParameter(
            f"{dtypes!r}: expected names of {', '.join(DTYPES)}", param_hint="--dtypes"
        )
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = dev.type != "cuda"
    n_iters = iters or (5 if cpu else 20)
    path = "torch fast path transfer_cpu (CPU; no Triton)" if cpu else "triton kernel"
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
    header = (
        f"{'dtype':<10}{'MB moved':>10}{'transfer ms':>13}{'transfer GB/s':>15}"
        f"{'unchecked GB/s':>16}{'copy GB/s':>11}{'ratio':>7}"
    )
    header += f"{'reference ms':>14}{'reference GB/s':>16}{'speedup':>9}"
    click.echo(header)
    for name in names:
        r = run_one(DTYPES[name], layers, heads, head_dim, tokens, n_iters, dev)
        results["dtypes"][name] = r
        line = (
            f"{name:<10}{r['bytes_moved'] / 1e6:>10.0f}{r['transfer_s'] * 1e3:>13.1f}"
            f"{r['transfer_gbps']:>15.2f}{r['transfer_unchecked_gbps']:>16.2f}"
            f"{r['copy_gbps']:>11.2f}{r['ratio']:>7.2f}"
        )
        line += (
            f"{r['reference_s'] * 1e3:>14.1f}{r['reference_gbps']:>16.2f}"
            f"{r['speedup_vs_reference']:>9.2f}"
        )
        click.echo(line)
    if json_path:
        write_json(json_path, results)
        click.echo(f"wrote {json_path}")
