"""Time one layer of extend attention: sglang 0.5.23's torch_native path vs the query-only path.

SmolLM2-135M shape (9 query heads, 3 KV heads, head dim 64, float32), 2,048 keys, one request:
(a) cold 2,048; (b) exact hit 2,016 cached + 32 new; (c) sparse: 1,900 reused + 148 computed
(18 spans of 100 reused positions after 8 computed heads each, 100 more reused, the last 4
computed). sglang's path
cannot run (c) (it places the queries at [m, n)); its column for (c) is the nearest request it
does run: an exact hit of 1,900 + 148 new. Runs alternate between the two paths; medians.

    .venv/bin/python scripts/bench_sparse_extend.py [--reps 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from semblend_sglang.cpu_runtime import ensure_torchvision_importable
from semblend_sglang.kernels.sparse_extend import ExtendRows, extend_attention_query_only

HQ, HKV, D, N = 9, 3, 64, 2048


def _sparse_positions() -> torch.Tensor:
    """148 computed of 2,048: 8 span heads every 108 positions (18 spans of 100 reused) from 0,
    then 100 more reused, then the last 4 positions."""
    heads = [s + i for s in range(0, 18 * 108, 108) for i in range(8)]
    return torch.tensor([*heads, *range(N - 4, N)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ensure_torchvision_importable()
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    shipped = TorchNativeAttnBackend._run_sdpa_forward_extend
    backend = object.__new__(TorchNativeAttnBackend)
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(N + 8, HKV, D, generator=g)
    v_cache = torch.randn(N + 8, HKV, D, generator=g)
    req_to_token = torch.arange(N, dtype=torch.int32)[None, :]
    one = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([N])

    def run_shipped(m: int) -> Callable[[], None]:
        q = torch.randn(N - m, HQ, D, generator=g)
        out = torch.empty_like(q)
        pre, ext = torch.tensor([m]), torch.tensor([N - m])

        def go() -> None:
            shipped(
                backend, q, out, k_cache, v_cache, req_to_token, one, seq, pre, ext,
                scaling=D**-0.5, enable_gqa=True, causal=True,
            )  # fmt: skip

        return go

    def run_query_only(pos: torch.Tensor) -> Callable[[], None]:
        q = torch.randn(pos.numel(), HQ, D, generator=g)
        out = torch.empty_like(q)
        ext = torch.tensor([pos.numel()])

        def go() -> None:
            extend_attention_query_only(
                q, k_cache, v_cache, out, ExtendRows(req_to_token, one, seq, ext, pos),
                scaling=D**-0.5, enable_gqa=True,
            )  # fmt: skip

        return go

    sparse = _sparse_positions()
    assert sparse.numel() == 148 and int(sparse[-1]) == N - 1
    cases = [
        ("(a) cold 2,048", run_shipped(0), run_query_only(torch.arange(N))),
        ("(b) exact 2,016 + 32", run_shipped(N - 32), run_query_only(torch.arange(N - 32, N))),
        ("(c) sparse 1,900 + 148", run_shipped(N - 148), run_query_only(sparse)),
    ]
    print(f"threads={torch.get_num_threads()} reps={args.reps}")
    print("wall ms and process CPU ms (all threads), medians")
    head = f"{'case':24} {'sglang wall':>11} {'q-only wall':>11} {'ratio':>6}"
    print(f"{head} {'sglang cpu':>10} {'q-only cpu':>10} {'ratio':>6}")
    for name, a, b in cases:
        a(), b()  # warm-up
        wall: tuple[list[float], list[float]] = ([], [])
        cpu: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.reps):
            for i, fn in enumerate((a, b)):
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[i].append((time.perf_counter() - t0) * 1e3)
                cpu[i].append((time.process_time() - c0) * 1e3)
        wa, wb = statistics.median(wall[0]), statistics.median(wall[1])
        ca, cb = statistics.median(cpu[0]), statistics.median(cpu[1])
        row = f"{name:24} {wa:11.1f} {wb:11.1f} {wa / wb:5.1f}x"
        print(f"{row} {ca:10.1f} {cb:10.1f} {ca / cb:5.1f}x")


if __name__ == "__main__":
    main()
