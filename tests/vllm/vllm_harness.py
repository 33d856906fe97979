"""Scheduler-level harness: vLLM 0.32's real Scheduler with SemBlendConnector, driven on CPU.

`VllmHarness` builds a `VllmConfig` with `DeviceConfig("cpu")` and a `ModelConfig` of the prepared
SmolLM2 folder (its config.json only: `skip_tokenizer_init`, no weights), a one-group
`KVCacheConfig`, and vLLM's own `Scheduler`, which creates the scheduler-side connector from
`kv_transfer_config` exactly as the engine does (KVConnectorFactory, `bind_kv_cache_manager`).
A second `SemBlendConnector` in the worker role gets per-layer cache tensors in vLLM 0.32's CPU
layout ([blocks, kv_heads, block_size, 2 * head_size], LBHNC).

One `step()` is what EngineCore does per step with a model runner in between:
`scheduler.schedule()`; the worker connector binds the step's metadata and runs `start_load_kv`;
the "forward" writes deterministic KV for every scheduled token (below); the worker's load errors
go back as `KVConnectorOutput.invalid_block_ids`; `scheduler.update_from_output`.

Deterministic KV (tests/harness/kv_model.py `cold_kv`): K/V at position p is a function of
(token, p, h_p, namespace, layer) with h_p = H(h_{p-1}, token_p), h_{p-1} read back from V of
the request's own slot p-1. KV loaded from a donor therefore carries the donor's context into
every later position, as a real model does; a block is "cold" exactly when it equals `cold_kv`
of its token path. Only the "forward" is a stand-in (no vLLM CPU kernels in the PyPI wheel);
everything vLLM decides is vLLM's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_block_hash, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from semblend_sglang.patches.vllm.connector import SemBlendConnector
from tests.harness.kv_model import chain_hash, chain_hashes, cold_kv, namespace_seed

CONNECTOR_MODULE = "semblend_sglang.patches.vllm.connector"
EOS = 2


class InvariantViolation(AssertionError):
    """A safety rule of docs/architecture.md is broken in the vLLM state."""


@dataclass
class HarnessConfig:
    """Engine shape: blocks, block size, per-step token budget, layers with a cache tensor."""

    mode: str = "exact_prefix"
    extra: dict[str, Any] = field(default_factory=dict)
    prefix_caching: bool = True
    block_size: int = 16
    num_blocks: int = 256
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 8
    layers: int = 2
    failure_policy: str = "recompute"


@dataclass
class Tracked:
    """What the harness remembers of a submitted request."""

    request: Request
    ns_id: int
    finished: bool = False
    first_loaded_block: int | None = None
    public_hashes: list[bytes] = field(default_factory=list)


def vllm_config(model_dir: Path, cfg: HarnessConfig) -> VllmConfig:
    """A CPU VllmConfig for the prepared model folder, with SemBlendConnector configured."""
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
    sched = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=8192,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(
        block_size=cfg.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=cfg.prefix_caching,
    )
    extra = {"mode": cfg.mode, "min_prompt_tokens": 64, "embedder_type": "jaccard", **cfg.extra}
    kv = KVTransferConfig(
        kv_connector="SemBlendConnector",
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_load_failure_policy=cfg.failure_policy,
        kv_connector_extra_config=extra,
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
    )


class VllmHarness:
    """The real vLLM scheduler + both connector roles + a deterministic "forward" on CPU."""

    def __init__(self, model_dir: Path, cfg: HarnessConfig | None = None) -> None:
        self.cfg = cfg or HarnessConfig()
        self.config = vllm_config(model_dir, self.cfg)
        init_none_hash(sha256)
        self.block_size = self.cfg.block_size
        hf = self.config.model_config.hf_config
        self.heads = int(hf.num_key_value_heads)
        self.head_dim = int(hf.hidden_size // hf.num_attention_heads)
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(self.cfg.layers)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=self.cfg.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    layer_names,
                    FullAttentionSpec(
                        block_size=self.block_size,
                        num_kv_heads=self.heads,
                        head_size=self.head_dim,
                        dtype=torch.float32,
                    ),
                )
            ],
        )
        self.config.cache_config.num_gpu_blocks = self.cfg.num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=self.block_size,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, SemBlendConnector), type(connector)
        self.connector: SemBlendConnector = connector
        self.worker = SemBlendConnector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        shape = (self.cfg.num_blocks, self.heads, self.block_size, 2 * self.head_dim)
        self.caches = {name: torch.zeros(shape) for name in layer_names}
        self.worker.register_kv_caches(self.caches)
        self.hasher = get_request_block_hasher(self.block_size, sha256)
        self.tracked: dict[str, Tracked] = {}
        self.load_jobs: list[tuple[Any, list[str]]] = []
        """Every load job sent, with the donors whose blocks it reads."""
        self.steps = 0
        self.connector_stats: list[dict[str, Any]] = []
        """Every ``SchedulerStats.kv_connector_stats`` payload vLLM's scheduler produced."""
        self.public_cache: dict[tuple[str, int], dict[bytes, tuple[list[int], int]]] = {}
        self.expected_pages: dict[bytes, torch.Tensor] = {}
        self._ids = itertools.count()
        self.namespaces: dict[tuple[str | None, str | None], int] = {(None, None): 0}

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        tokens: Sequence[int],
        *,
        max_tokens: int = 4,
        cache_salt: str | None = None,
        lora: str | None = None,
        rid: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> Request:
        """Add a generation request for ``tokens`` (greedy, ``max_tokens`` new tokens;
        ``prompt_logprobs`` makes vLLM set ``skip_reading_prefix_cache``)."""
        sp = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            prompt_logprobs=prompt_logprobs,
        )
        sp.update_from_generation_config({}, EOS)
        lora_request = None if lora is None else LoRARequest(lora, 1 + len(lora), "/nonexistent")
        request = Request(
            request_id=rid or f"r{next(self._ids):05d}",
            prompt_token_ids=[int(t) for t in tokens],
            sampling_params=sp,
            pooling_params=None,
            lora_request=lora_request,
            cache_salt=cache_salt,
            block_hasher=self.hasher,
        )
        ns_id = self.namespaces.setdefault((cache_salt, lora), len(self.namespaces))
        self.tracked[request.request_id] = Tracked(
            request, ns_id, public_hashes=list(request.block_hashes)
        )
        self.scheduler.add_request(request)
        return request

    def abort(self, request: Request) -> None:
        """Abort like the engine does (``finish_requests`` with FINISHED_ABORTED)."""
        self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
        self.tracked[request.request_id].finished = True

    def idle(self) -> bool:
        """No request waiting or running."""
        return not self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ steps
    def step(self) -> Any:
        """One engine step; returns the SchedulerOutput."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        side = self.connector.scheduler_side
        assert side is not None
        for job in getattr(meta, "loads", []):
            n = len(job.donor_block_ids)
            donors = [
                rid
                for rid, d in side._donors.items()
                if n and tuple(b.block_id for b in d.blocks[:n]) == job.donor_block_ids
            ]
            self.load_jobs.append((job, donors))
            t = self.tracked[job.request_id]
            first = job.target_start // self.block_size
            if t.first_loaded_block is None or first < t.first_loaded_block:
                t.first_loaded_block = first
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        invalid = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            start = request.num_computed_tokens - n
            self.forward(request, start, start + n, skip_blocks=invalid)
            req_ids.append(rid)
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([self._next_token(request)] if done else [])
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid),
        )
        outputs = self.scheduler.update_from_output(out, runner)
        for engine_out in outputs.values():
            stats = engine_out.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
            for o in engine_out.outputs:
                if o.finish_reason is not None:
                    self.tracked[o.request_id].finished = True
        self.steps += 1
        return out

    def run_until_idle(self, max_steps: int = 2000, check: bool = True) -> None:
        """Step until no request is left; check the invariants after every step."""
        for _ in range(max_steps):
            if self.idle():
                return
            self.step()
            if check:
                check_invariants(self)
        raise AssertionError(f"not idle after {max_steps} steps")

    def _next_token(self, request: Request) -> int:
        return 100 + (request.num_tokens * 7) % 900

    # ------------------------------------------------------------------ KV model
    def slot(self, request: Request, position: int) -> tuple[int, int]:
        """(block id, offset) of ``position`` in the request's blocks."""
        ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        return ids[position // self.block_size], position % self.block_size

    def kv_at(self, layer: int, block: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [heads, head_dim] of one slot, read the way vLLM's CPU backend reads them."""
        kv = self.caches[f"model.layers.{layer}.self_attn.attn"]
        page = kv[block].view(self.heads, 2 * self.block_size, self.head_dim)
        return page[:, offset], page[:, self.block_size + offset]

    def forward(self, request: Request, start: int, end: int, skip_blocks: set[int]) -> None:
        """Write the deterministic KV of positions [start, end) of ``request`` (a step in which
        a load failed writes nothing into the failed blocks: vLLM recomputes them later)."""
        tokens = request.all_token_ids
        ns = self.tracked[request.request_id].ns_id
        prev = namespace_seed(ns)
        if start > 0:
            b, o = self.slot(request, start - 1)
            prev = int(self.kv_at(0, b, o)[1][0, 0])
        for p in range(start, end):
            b, o = self.slot(request, p)
            prev = chain_hash(prev, int(tokens[p]))
            if b in skip_blocks:
                continue
            self._store(b, o, int(tokens[p]), p, prev, ns)

    def _store(self, block: int, offset: int, token: int, pos: int, h: int, ns: int) -> None:
        t = torch.tensor([token])
        for layer in range(self.cfg.layers):
            k, v = cold_kv(
                t,
                torch.tensor([pos]),
                torch.tensor([h]),
                torch.tensor([ns]),
                layer,
                self.heads,
                self.head_dim,
            )
            kk, vv = self.kv_at(layer, block, offset)
            kk.copy_(k[0])
            vv.copy_(v[0])

    def expected_cold(self, tokens: Sequence[int], ns_id: int, layer: int, pos: int) -> tuple:
        """K, V a cold prefill of ``tokens`` writes at ``pos``."""
        h = chain_hashes(namespace_seed(ns_id), tokens[: pos + 1])[-1]
        k, v = cold_kv(
            torch.tensor([tokens[pos]]),
            torch.tensor([pos]),
            torch.tensor([h]),
            torch.tensor([ns_id]),
            layer,
            self.heads,
            self.head_dim,
        )
        return k[0], v[0]


# ---------------------------------------------------------------------- invariants
def _manager(h: VllmHarness) -> Any:
    return h.scheduler.kv_cache_manager.coordinator.single_type_managers[0]


def check_invariants(h: VllmHarness) -> None:
    """Raise InvariantViolation unless: every block's reference count is exactly the requests
    holding it plus the connector's donor pins and load leases (nothing double-held or
    double-freed); the free queue holds exactly the unreferenced blocks; no block from a
    recipient's first loaded block on is published under a public hash; every block published
    under a public hash holds the cold KV of its token path; every load job's donor is in its
    recipient's namespace."""
    pool = h.scheduler.kv_cache_manager.block_pool
    side = h.connector.scheduler_side
    assert side is not None
    expected = [0] * len(pool.blocks)
    for blocks in _manager(h).req_to_blocks.values():
        for b in blocks:
            if not b.is_null:
                expected[b.block_id] += 1
    for donor in side._donors.values():
        for b in donor.blocks:
            expected[b.block_id] += 1
    for leases in side._leases.values():
        for lease in leases:
            for b in lease:
                expected[b.block_id] += 1
    for b in pool.blocks:
        if b.is_null:
            continue
        if b.ref_cnt != expected[b.block_id]:
            raise InvariantViolation(
                f"block {b.block_id}: ref_cnt {b.ref_cnt} != {expected[b.block_id]} holders"
            )
    free = sum(1 for b in pool.blocks if b.ref_cnt == 0 and not b.is_null)
    if pool.get_num_free_blocks() != free:
        raise InvariantViolation(f"free queue {pool.get_num_free_blocks()} != {free} free blocks")
    _check_publication(h, pool)
    ns = {rid: t.ns_id for rid, t in h.tracked.items()}
    for job, donors in h.load_jobs:
        if job.failed:
            continue
        if not donors:
            raise InvariantViolation(f"load job {job} reads blocks no held donor owns")
        if any(ns[d] != ns[job.request_id] for d in donors):
            raise InvariantViolation(f"load job {job} crosses namespaces ({donors})")


def _public_paths(h: VllmHarness) -> dict[bytes, tuple[list[int], int]]:
    """Public block hash -> (token path up to the block's end, namespace id), for every tracked
    request (prompt and output tokens, hashed as vLLM hashes them, without any private salt).
    Cached per request and token count."""
    out: dict[bytes, tuple[list[int], int]] = {}
    for rid, t in h.tracked.items():
        r = t.request
        key = (rid, r.num_tokens)
        paths = h.public_cache.get(key)
        if paths is None:
            tokens = list(r.all_token_ids)
            shadow = Request(
                request_id="shadow",
                prompt_token_ids=tokens,
                sampling_params=r.sampling_params,
                pooling_params=None,
                lora_request=r.lora_request,
                cache_salt=r.cache_salt,
                block_hasher=h.hasher,
            )
            paths = {
                bytes(bh): (tokens[: (k + 1) * h.block_size], t.ns_id)
                for k, bh in enumerate(shadow.block_hashes)
            }
            h.public_cache[key] = paths
        out.update(paths)
    return out


def _expected_block(h: VllmHarness, bh: bytes, tokens: list[int], ns: int) -> torch.Tensor:
    """Cold KV pages [layers, heads, 2 * block_size, head_dim] of the block ending the path."""
    got = h.expected_pages.get(bh)
    if got is None:
        first = len(tokens) - h.block_size
        hashes = chain_hashes(namespace_seed(ns), tokens)[first:]
        pages = []
        for layer in range(h.cfg.layers):
            k, v = cold_kv(
                torch.tensor(tokens[first:]),
                torch.arange(first, len(tokens)),
                torch.tensor(hashes),
                torch.full((h.block_size,), ns),
                layer,
                h.heads,
                h.head_dim,
            )
            pages.append(torch.cat([k.transpose(0, 1), v.transpose(0, 1)], dim=1))
        got = torch.stack(pages)
        h.expected_pages[bh] = got
    return got


def _check_publication(h: VllmHarness, pool: Any) -> None:
    public = _public_paths(h)
    owner: dict[int, tuple[str, int]] = {}
    for rid, blocks in _manager(h).req_to_blocks.items():
        for k, b in enumerate(blocks):
            owner.setdefault(b.block_id, (rid, k))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(h.cfg.layers)]
    for b in pool.blocks:
        key = b.block_hash
        if key is None:
            continue
        bh = bytes(get_block_hash(key))
        if bh not in public:
            continue  # a request-private hash: never matched by another request
        rid_k = owner.get(b.block_id)
        if rid_k is not None:
            t = h.tracked.get(rid_k[0])
            if t and t.first_loaded_block is not None and rid_k[1] >= t.first_loaded_block:
                raise InvariantViolation(
                    f"block {b.block_id} ({rid_k[0]} block {rid_k[1]}, at/after its first loaded "
                    "block) is published under a public hash"
                )
        tokens, ns = public[bh]
        want = _expected_block(h, bh, tokens, ns)
        got = torch.stack(
            [h.caches[n][b.block_id].view(h.heads, 2 * h.block_size, h.head_dim) for n in names]
        )
        if not torch.equal(got, want):
            raise InvariantViolation(
                f"block {b.block_id} is published under a public hash but does not hold the "
                f"cold KV of its tokens (positions {len(tokens) - h.block_size}..{len(tokens) - 1})"
            )
