"""GPU check (issue 30): sglang 0.5.23's real Triton extend_attention_fwd, compiled, over the
split view's metadata (each computed run an ordinary prefix + causal extend sequence) and over
the former custom-mask metadata, against the float64 position-masked reference; then both timed
on long sparse requests beside an exact hit computing as many tokens (the floor).

Runs on the GPU machine from the repo root with .gpu/ carried, as built here by
scripts/gpu_split_view_kit.sh: sglang 0.5.23's kernel files verbatim, import shims for the two
sglang modules they import at load time (env flags off, CUDA probes), and copies of this repo's
torch-only modules at their package paths (split_view.py, batch_fields.py, sparse_extend.py,
sparse_extend_triton.py, tests/sparse_extend_batches.py). Writes $OUT/split_view_gpu.json;
recorded in docs/perf.md ("Split view on a GPU").

    bash scripts/gpu_split_view_kit.sh && python3 scripts/gpu_split_view.py
"""

import functools
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path[:0] = [".gpu/site"]
import torch  # noqa: E402
import triton  # noqa: E402
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402

from semblend_sglang.kernels.sparse_extend import extend_attention_reference  # noqa: E402
from semblend_sglang.kernels.sparse_extend_triton import build_sparse_extend_metadata  # noqa: E402
from semblend_sglang.patches.sglang.attention.split_view import split_sequences  # noqa: E402
from tests.sparse_extend_batches import random_batch  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", ".")


def fb_of(b):
    return SimpleNamespace(
        extend_prefix_lens=b.extend_prefix_lens,
        extend_prefix_lens_cpu=b.extend_prefix_lens.tolist(),
        extend_seq_lens=b.extend_seq_lens,
        extend_seq_lens_cpu=b.extend_seq_lens.tolist(),
        seq_lens=b.seq_lens,
        seq_lens_cpu=b.seq_lens.cpu(),
        positions=b.positions,
    )


def split_metadata(b):
    """What TritonAttnBackend.init_forward_metadata builds for an extend batch, fed the view."""
    seqs = split_sequences(fb_of(b))
    if seqs is None:
        req = list(range(b.seq_lens.numel()))
        prefix, extend = b.extend_prefix_lens.tolist(), b.extend_seq_lens.tolist()
    else:
        req, prefix, extend = seqs.request, seqs.prefix, seqs.extend
    rows = b.req_pool_indices.tolist()
    qo = torch.zeros(len(req) + 1, dtype=torch.int64, device=DEV)
    qo[1:] = torch.cumsum(torch.tensor(extend, device=DEV), 0)
    kv = torch.zeros(len(req) + 1, dtype=torch.int32, device=DEV)
    kv[1:] = torch.cumsum(torch.tensor(prefix, device=DEV), 0)
    parts = [b.req_to_token[rows[r], :s].long() for r, s in zip(req, prefix, strict=True)]
    idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=DEV)
    return qo, kv, idx, max(extend), len(req)


def run_split(b, out, scale):
    qo, kv, idx, mx, _ = split_metadata(b)
    extend_attention_fwd(
        b.q,
        b.k,
        b.v,
        out,
        b.k_cache,
        b.v_cache,
        qo,
        kv,
        idx,
        None,
        True,
        None,
        mx,
        1.0,
        1.0,
        sm_scale=scale,
    )
    return out


def run_mask(b, out, scale, md=None):
    md = md or build_sparse_extend_metadata(b.rows())
    extend_attention_fwd(
        b.q,
        b.k,
        b.v,
        out,
        b.k_cache,
        b.v_cache,
        md.qo_indptr,
        md.kv_indptr,
        md.kv_indices,
        md.custom_mask,
        True,
        md.mask_indptr,
        md.max_extend_len,
        1.0,
        1.0,
        sm_scale=scale,
        skip_prefix_custom_mask=False,
    )
    return out


def to_dev(b, dtype):
    fields = {k: getattr(b, k) for k in b.__dataclass_fields__}
    for k, v in fields.items():
        if isinstance(v, torch.Tensor):
            v = v.to(DEV)
            if k in ("q", "k", "v", "k_cache", "v_cache"):
                v = v.to(dtype).contiguous()
            fields[k] = v
    return type(b)(**fields)


def correctness():
    rows = []
    for dtype, tol in ((torch.float32, 1e-2), (torch.bfloat16, 3e-2)):
        for seed in range(6):
            heads = [(8, 2), (4, 4), (32, 8), (6, 3), (16, 1), (8, 8)][seed]
            cpu = random_batch(
                seed, n_requests=6, max_len=700, min_len=3, heads=heads, head_dim=128
            )
            b = to_dev(cpu, dtype)
            scale = 128**-0.5
            ref = extend_attention_reference(
                b.q.double(),
                b.k_cache.double(),
                b.v_cache.double(),
                b.rows(),
                scaling=scale,
            )
            s = run_split(b, torch.full_like(b.q, float("nan")), scale).double()
            m = run_mask(b, torch.full_like(b.q, float("nan")), scale).double()
            es, em = (s - ref).abs().max().item(), (m - ref).abs().max().item()
            rows.append(
                {
                    "dtype": str(dtype),
                    "seed": seed,
                    "heads": heads,
                    "kinds": cpu.kinds,
                    "split_err": es,
                    "mask_err": em,
                    "tol": tol,
                    "split_ok": es <= tol,
                    "mask_ok": em <= tol,
                }
            )
            print(rows[-1], flush=True)
    return rows


def long_batch(n, runs, share, n_requests, hq=32, hkv=8, d=128, seed=0, exact=False):
    """n_requests requests of n tokens; each computes `share` of its positions (the last always)
    in `runs` equal runs spread over the row (exact: one run at the end, an exact hit)."""
    g = torch.Generator().manual_seed(seed)
    c = max(runs, int(n * share))
    prefix, counts, pos_all = [], [], []
    pool = n * n_requests + 16
    slots = torch.randperm(pool, generator=g)
    r2t = torch.zeros(n_requests + 1, n, dtype=torch.int32)
    for i in range(n_requests):
        r2t[i, :n] = slots[i * n : (i + 1) * n].int()
        if exact:
            pos = torch.arange(n - c, n)
            prefix.append(n - c)
        else:
            per = c // runs
            starts = torch.linspace(0, n - per, runs).long()
            starts[-1] = n - per
            pos = torch.unique(torch.cat([torch.arange(s, s + per) for s in starts.tolist()]))
            prefix.append(int(pos[0]))
        counts.append(pos.numel())
        pos_all.append(pos)
    pos_all = torch.cat(pos_all)
    t = pos_all.numel()
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    b = SimpleNamespace(
        q=mk(t, hq, d).to(DEV),
        k=mk(t, hkv, d).to(DEV),
        v=mk(t, hkv, d).to(DEV),
        k_cache=mk(pool, hkv, d).to(DEV),
        v_cache=mk(pool, hkv, d).to(DEV),
        req_to_token=r2t.to(DEV),
        req_pool_indices=torch.arange(n_requests, device=DEV),
        seq_lens=torch.full((n_requests,), n, device=DEV),
        extend_prefix_lens=torch.tensor(prefix, device=DEV),
        extend_seq_lens=torch.tensor(counts, device=DEV),
        positions=pos_all.to(DEV),
    )
    return b


def timing():
    rows = []
    scale = 128**-0.5
    for n in (4096, 8192):
        for n_req in (1, 4):
            floor_b = long_batch(n, 1, 0.15, n_req, exact=True)
            out = torch.empty_like(floor_b.q)
            t_floor = triton.testing.do_bench(
                functools.partial(run_split, floor_b, out, scale), warmup=10, rep=50
            )
            for runs in (4, 16, 64, 256):
                b = long_batch(n, runs, 0.15, n_req)
                out = torch.empty_like(b.q)
                md = build_sparse_extend_metadata(b.rows())
                t_split = triton.testing.do_bench(
                    functools.partial(run_split, b, out, scale), warmup=10, rep=50
                )
                t_mask_kernel = triton.testing.do_bench(
                    functools.partial(run_mask, b, out, scale, md), warmup=10, rep=50
                )
                t_mask_all = triton.testing.do_bench(
                    functools.partial(run_mask, b, out, scale), warmup=10, rep=50
                )
                t_split_md = triton.testing.do_bench(
                    functools.partial(split_metadata, b), warmup=5, rep=30
                )
                row = {
                    "n": n,
                    "requests": n_req,
                    "runs": runs,
                    "computed": int(b.extend_seq_lens.sum()),
                    "exact_floor_ms": t_floor,
                    "split_ms": t_split,
                    "split_metadata_ms": t_split_md,
                    "mask_kernel_ms": t_mask_kernel,
                    "mask_with_metadata_ms": t_mask_all,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    t0 = time.time()
    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    print(info, flush=True)
    corr = correctness()
    tim = timing()
    with open(os.path.join(OUT, "split_view_gpu.json"), "w") as f:
        json.dump(
            {"info": info, "correctness": corr, "timing": tim, "wall_s": time.time() - t0},
            f,
            indent=1,
        )
    print("done", time.time() - t0, flush=True)
