"""Scheduler-side half of the vLLM connector: donors, lookups, load jobs, publication guard.

Runs in vLLM's scheduler (EngineCore) process, called only by :class:`SemBlendConnector`'s
scheduler methods, on the scheduler thread. Donors are finished requests. In the loading modes
this class keeps their blocks alive by holding one reference each in vLLM's ``BlockPool``
(``touch`` / ``free_blocks``), up to ``donor_block_fraction`` of the pool, least recently
registered released first, and released before vLLM preempts a running request for lack of
blocks (``discovery_only`` holds no blocks: the provider keeps the donors' tokens). A load job
additionally holds the donor's blocks until the recipient finishes. Every reference taken is
returned exactly once. Blocks that receive donor KV, and every later block of that request, are
kept out of vLLM's prefix cache: the hashes published for them by ``allocate_slots`` are removed
and the request's remaining block hashes are replaced by request-private values.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Decision, Reason, ReusePlan
from semblend_sglang.provider import SemanticProvider

from .metadata import LoadJob, SemBlendConnectorMetadata
from .settings import ConnectorSettings

logger = logging.getLogger(__name__)

_PRIVATE_TAG = b"semblend-private\x00"


@dataclass(frozen=True, slots=True)
class LoadChoice:
    """What one lookup allows: ``num_tokens`` of ``donor`` from ``donor_start`` into the
    request's positions from ``target_start`` (0 tokens: nothing, ``reason`` says why)."""

    num_tokens: int
    reason: str
    donor: Hashable | None = None
    donor_start: int = 0
    target_start: int = 0


@dataclass
class _Donor:
    blocks: list[Any]
    tokens: np.ndarray


def private_block_hash(request_id: str, index: int, block_hash: bytes) -> bytes:
    """A block hash no other request can produce: keeps a block out of the shared prefix cache."""
    h = hashlib.sha256(_PRIVATE_TAG)
    h.update(request_id.encode("utf-8", "surrogatepass"))
    h.update(index.to_bytes(8, "little"))
    h.update(bytes(block_hash))
    return h.digest()


def namespace_of(request: Any, model: str, tokenizer: str) -> Namespace:
    """Reuse namespace of a vLLM request: served model, tokenizer, LoRA adapter, cache_salt."""
    lora = getattr(request, "lora_request", None)
    adapter = None if lora is None else f"{lora.lora_name}#{lora.lora_int_id}"
    return Namespace(
        model=model,
        tokenizer_fingerprint=tokenizer,
        adapter=adapter,
        cache_salt=getattr(request, "cache_salt", None),
    )


def eligible(request: Any) -> bool:
    """False for requests whose KV is not a function of their token ids alone (multimodal,
    prompt embeddings) and for pooling requests: never looked up, never donors."""
    return (
        getattr(request, "sampling_params", None) is not None
        and not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
        and getattr(request, "prompt_token_ids", None) is not None
    )


class SchedulerSide:
    """Donor registry, lookup and load planning for one vLLM scheduler.

    ``provider`` is the shared :class:`SemanticProvider`, built from ``settings.config``.
    ``model`` / ``tokenizer``: the namespace's model and tokenizer identity. Methods are called
    by the connector only; :meth:`choose` has no effect on vLLM state.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        block_size: int,
        prefix_caching: bool,
        model: str,
        tokenizer: str,
        unsupported: str | None = None,
    ) -> None:
        self.settings = settings
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.model = settings.config.model_id or model
        self.tokenizer = tokenizer
        self.unsupported = unsupported
        self.holds_blocks = settings.materializes
        """Loading modes hold donor blocks; discovery_only keeps only tokens (no KV memory)."""
        source = self._donor_tokens if self.holds_blocks else None
        self.provider = SemanticProvider(settings.config, source)
        self.pool: Any = None
        self.budget_blocks = 0
        self.pinned_blocks = 0
        self.released_donors = 0
        self.pressure_releases = 0
        """Donors released by :meth:`relieve_pressure` (a subset of ``released_donors``)."""
        self._donors: OrderedDict[str, _Donor] = OrderedDict()
        self._leases: dict[str, list[list[Any]]] = {}
        """Per recipient, the donor blocks its load jobs hold (one list per job)."""
        self._choices: dict[str, LoadChoice] = {}
        self._loads: list[LoadJob] = []

    # ------------------------------------------------------------------ binding
    def bind_pool(self, pool: Any) -> None:
        """Take vLLM's BlockPool (``bind_gpu_block_pool``); sizes the donor budget."""
        self.pool = pool
        total = int(getattr(pool, "num_gpu_blocks", 0) or len(getattr(pool, "blocks", ())))
        self.budget_blocks = int(self.settings.donor_block_fraction * total)
        if self.unsupported is None and getattr(pool, "hash_block_size", self.block_size) != (
            self.block_size
        ):
            self.unsupported = f"hash block size {pool.hash_block_size} != {self.block_size}"
        if self.unsupported is None and not hasattr(pool, "_maybe_evict_cached_block"):
            self.unsupported = "BlockPool has no _maybe_evict_cached_block (publication guard)"

    # ------------------------------------------------------------------ lookup
    def namespace(self, request: Any) -> Namespace:
        """The request's reuse namespace."""
        return namespace_of(request, self.model, self.tokenizer)

    def choose(self, request: Any, num_computed_tokens: int) -> LoadChoice:
        """What may be loaded for ``request`` beyond vLLM's ``num_computed_tokens`` (block-
        aligned). Looks the request up (the provider caches the first decision per request).
        A request with ``skip_reading_prefix_cache`` (vLLM sets it for ``prompt_logprobs`` and
        the per-request opt-out) gets 0 tokens and no lookup."""
        rid = request.request_id
        if getattr(request, "skip_reading_prefix_cache", False):
            # prompt_logprobs or the per-request opt-out: vLLM reads no cached KV for this
            # request, so neither may the connector (and it is not looked up at all).
            choice = LoadChoice(0, Reason.DISABLED)
        elif not eligible(request):
            choice = LoadChoice(0, Reason.OTHER)
        else:
            decision = self.provider.lookup(
                LookupParams(
                    self.namespace(request),
                    request.prompt_token_ids,
                    num_computed_tokens,
                    rid,
                    page_size=self.block_size,
                )
            )
            choice = self._choice_for(decision, num_computed_tokens)
        self._choices[rid] = choice
        return choice

    def _choice_for(self, decision: Decision, start: int) -> LoadChoice:
        if decision.kind != "plan" or decision.plan is None:
            return LoadChoice(0, decision.reason)
        if not self.settings.materializes:
            return LoadChoice(0, Reason.DISCOVERY_ONLY)
        if self.unsupported is not None or self.pool is None:
            return LoadChoice(0, Reason.UNSUPPORTED_CACHE)
        plan = decision.plan
        donor = self._donors.get(str(plan.donor_handle))
        if donor is None:
            return LoadChoice(0, Reason.DONOR_EVICTED)
        if self.settings.mode == "exact_prefix":
            return self._exact_prefix(plan, start, len(donor.tokens))
        return self._prefix_substitution(plan, start, len(donor.tokens))

    def _exact_prefix(self, plan: ReusePlan, start: int, donor_len: int) -> LoadChoice:
        span = plan.spans[0]
        if span.target_start != start:
            return LoadChoice(0, Reason.NOT_AT_BOUNDARY)
        if span.length < self.settings.config.min_reuse_tokens:
            return LoadChoice(0, Reason.REUSE_TOO_SMALL)
        if span.donor_end > donor_len:
            return LoadChoice(0, Reason.DONOR_EVICTED)
        return LoadChoice(span.length, Reason.PLANNED, plan.donor_handle, span.donor_start, start)

    def _prefix_substitution(self, plan: ReusePlan, start: int, donor_len: int) -> LoadChoice:
        # From the boundary through the last span with the first span's shift: whatever lies
        # between (other tokens, spans with other shifts) is substituted by the donor's KV.
        delta = plan.spans[0].delta
        end = max(span.target_end for span in plan.spans if span.delta == delta)
        donor_start = start - delta
        n = (end - start) // self.block_size * self.block_size
        if donor_start < 0 or donor_start + n > donor_len:
            return LoadChoice(0, Reason.NOT_AT_BOUNDARY)
        if n < self.settings.config.min_reuse_tokens:
            return LoadChoice(0, Reason.REUSE_TOO_SMALL)
        return LoadChoice(n, Reason.PLANNED, plan.donor_handle, donor_start, start)

    # ------------------------------------------------------------------ allocation
    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated ``blocks`` (the request's KVCacheBlocks) and counts
        ``num_external_tokens`` as loaded: queue the load job, hold the donor's blocks for it,
        and keep the request's blocks from the first loaded one on out of the prefix cache.
        With 0 external tokens, settle the request's plan (if any) as declined. Once tokens are
        counted as loaded, any failure still queues a job, marked failed (the worker reports
        its blocks and vLLM recomputes them)."""
        rid = request.request_id
        choice = self._choices.pop(rid, None)
        if num_external_tokens <= 0:
            planned = choice is None or choice.reason == Reason.PLANNED
            self.provider.record_declined(rid, Reason.ENGINE_DECLINED if planned else choice.reason)
            return
        block_ids: list[int] = list(blocks.get_block_ids()[0])
        try:
            why = self._queue_load(request, block_ids, choice, num_external_tokens)
        except Exception:
            self._queue_failed(request, block_ids, choice, num_external_tokens, "error")
            raise
        if why is not None:
            self._queue_failed(request, block_ids, choice, num_external_tokens, why)

    def _queue_load(
        self, request: Any, block_ids: list[int], choice: LoadChoice | None, n: int
    ) -> str | None:
        """Queue the job for ``choice``; returns why it cannot be (None: queued)."""
        rid = request.request_id
        leases = self._leases.setdefault(rid, [])
        if choice is None:  # unknown range: keep every block of the request private
            self._keep_private(request, block_ids, 0)
            return "no_choice"
        start = choice.target_start
        first_block = start // self.block_size
        self._keep_private(request, block_ids, first_block)
        donor = self._donors.get(str(choice.donor))
        if donor is None or n > choice.num_tokens:
            return "donor_gone"
        need = -(-(choice.donor_start + n) // self.block_size)
        donor_blocks = donor.blocks[:need]
        donor_ids = {b.block_id for b in donor_blocks}
        last = (start + n - 1) // self.block_size
        targets = [self.pool.blocks[i] for i in block_ids[first_block : last + 1]]
        if len(targets) != last + 1 - first_block or any(
            b.block_id in donor_ids or b.ref_cnt != 1 for b in targets
        ):
            return "shared_target"
        self.pool.touch(donor_blocks)
        leases.append(donor_blocks)
        self._loads.append(
            LoadJob(
                request_id=rid,
                donor_block_ids=tuple(b.block_id for b in donor_blocks),
                target_block_ids=tuple(block_ids),
                donor_start=choice.donor_start,
                target_start=start,
                num_tokens=n,
            )
        )
        self.provider.record_materialized(rid, n)
        return None

    def _queue_failed(
        self, request: Any, block_ids: list[int], choice: LoadChoice | None, n: int, why: str
    ) -> None:
        start = choice.target_start if choice is not None else 0
        self._loads.append(
            LoadJob(request.request_id, (), tuple(block_ids), start, start, n, failed=True)
        )
        self.provider.record_cold_fallback(request.request_id, where=f"vllm_alloc:{why}")

    def _keep_private(self, request: Any, block_ids: Sequence[int], first_block: int) -> None:
        if not self.prefix_caching or self.pool is None:
            return
        for bid in block_ids[first_block:]:
            block = self.pool.blocks[bid]
            if block.block_hash is not None:
                self.pool._maybe_evict_cached_block(block)
        hashes = request.block_hashes
        for k in range(first_block, len(hashes)):
            hashes[k] = private_block_hash(request.request_id, k, hashes[k])

    def build_meta(self) -> SemBlendConnectorMetadata:
        """This step's load jobs; the queue is emptied."""
        meta = SemBlendConnectorMetadata(loads=self._loads)
        self._loads = []
        return meta

    # ------------------------------------------------------------------ finish
    def finished(self, request: Any, block_ids: Sequence[int]) -> None:
        """The request finished (``block_ids``: its computed blocks, still held by it): return
        its leases, forget its decision, and register it as a donor unless it received donor
        KV (its blocks are then held by this class)."""
        rid = request.request_id
        self._choices.pop(rid, None)
        leases = self._leases.pop(rid, None)
        for blocks in leases or ():
            self.pool.free_blocks(blocks)
        self.provider.release(rid)
        if leases is None and eligible(request) and self.pool is not None:
            self._register(request, block_ids)

    def _register(self, request: Any, block_ids: Sequence[int]) -> None:
        processed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        n = min(len(request.prompt_token_ids), processed, len(block_ids) * self.block_size)
        rid = request.request_id
        if not self.holds_blocks:
            self.provider.register(self.namespace(request), rid, request.prompt_token_ids[:n])
            return
        if n < self.settings.config.min_span_tokens or self.budget_blocks <= 0:
            return
        self._unpin(rid)
        blocks = [self.pool.blocks[i] for i in block_ids[: -(-n // self.block_size)]]
        if len(blocks) > self.budget_blocks or any(b.is_null for b in blocks):
            return
        self.pool.touch(blocks)
        self.pinned_blocks += len(blocks)
        self._donors[rid] = _Donor(blocks, np.asarray(request.prompt_token_ids[:n], np.int32))
        self.provider.register(self.namespace(request), rid, self._donors[rid].tokens)
        if rid not in self.provider.index:
            self._unpin(rid)
        while self.pinned_blocks > self.budget_blocks and self._donors:
            self._forget(next(iter(self._donors)))
        if len(self.provider.index) < len(self._donors):
            for handle in [h for h in self._donors if h not in self.provider.index]:
                self._unpin(handle)

    def relieve_pressure(self) -> bool:
        """vLLM could not allocate blocks for a running request and is about to preempt one
        (``has_pending_block_frees``): return donor blocks first. Donors are released least
        recently registered first until the pool's free count has grown by half the blocks
        the donors held (at least one block), or no donor is left. True when the free count
        grew: vLLM then retries the allocation next step instead of preempting. A donor whose
        blocks are all still held by others (running requests, load leases) frees nothing, so
        repeated calls end with no donors and False, and vLLM preempts as it would without
        the connector."""
        if self.pool is None or not self._donors:
            return False
        before = self.pool.get_num_free_blocks()
        want = max(1, self.pinned_blocks // 2)
        while self._donors and self.pool.get_num_free_blocks() - before < want:
            self._forget(next(iter(self._donors)))
            self.pressure_releases += 1
        return self.pool.get_num_free_blocks() > before

    def _forget(self, handle: str) -> None:
        self._unpin(handle)
        self.provider.forget(handle)
        self.released_donors += 1

    def _unpin(self, handle: str) -> None:
        donor = self._donors.pop(handle, None)
        if donor is not None:
            self.pool.free_blocks(donor.blocks)
            self.pinned_blocks -= len(donor.blocks)

    def _donor_tokens(self, handle: Hashable) -> np.ndarray | None:
        donor = self._donors.get(str(handle))
        return None if donor is None else donor.tokens

    def release_all(self) -> None:
        """Return every reference this side holds (connector shutdown)."""
        for rid in list(self._leases):
            for blocks in self._leases.pop(rid):
                self.pool.free_blocks(blocks)
        for handle in list(self._donors):
            self._forget(handle)

    @property
    def donors(self) -> int:
        """Donors currently held."""
        return len(self._donors)
