"""One-pass sparse extend: copy every reused span of a prefill batch, then
let the forward compute only the positions that were not reused.

Called after ``ScheduleBatch.prepare_for_extend`` (which laid each request's ``req_to_token`` row
out in position order with fresh slots for [prefix_len, extend_end)): for each request with an
open plan, the parts of its spans inside this chunk are copied from their donors into the fresh
slots at those positions (K rotated by each span's delta; all spans of the batch in one kernel
launch), and the batch's computed tokens drop those positions
(:func:`.batch_fields.keep_scheduled_tokens`). The true positions of the computed tokens are kept
on the batch (:class:`.batch_state.BatchReuse`) for ``ForwardBatch.init_new``
(:func:`.batch_state.forward_positions`); the attention backend then masks by position.

The last position of every chunk is always computed: a chunk never has nothing to compute, and
the final chunk computes the last prompt token (the logits). Positions whose input-token
logprobs are asked for are computed too (sglang reads them as the tail of the computed tokens).
Donors are locked only for the copy. A donor whose KV left the device costs only its own spans
(they are computed instead). Where ranks run the batch together (tensor- or context-parallel
attention), what was copied is agreed across them before the batch changes
(:mod:`.rank_agreement`): a position is reused only where every rank copied it.

What differs between sglang versions (rows, chunk ends, locks, where a donor's KV is) is the
adapter's :class:`~.version_view.VersionView`; the plans are :mod:`.request_flow`'s, advanced
here through their own transitions.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from semblend_sglang.align import Span
from semblend_sglang.plan import Reason
from semblend_sglang.recompute import CheckSampling

from .. import batch_fields, rank_agreement
from ..request_info import sparse_extend_refusal, wants_dense_reference
from ..version_view import VersionView
from .batch_state import CheckCandidates, own_batch_reuse
from .donor_kv import DonorKV, DonorMatchParams
from .request_reuse import RequestReuse


@dataclass(frozen=True)
class LoadParams:
    """One prepared prefill batch to load: its ``cache`` and ``batch``, the open plans of its
    requests (``states`` by rid), the version's ``view``, the ``donors`` (where a donor's KV is:
    :meth:`.DonorKV.match`), the model's RoPE ``spec``, the ranks that run it too (``peers``),
    whether the model's layers take the check-layer hook (``check``: a plan whose settings
    select at a check layer is checked there on its settings' sample) and the stream the
    engine's forward runs on (``forward_stream``; None on CPU)."""

    cache: Any
    batch: Any
    states: Mapping[str, RequestReuse]
    view: VersionView
    donors: DonorKV
    spec: Any
    peers: list[Any]
    check: bool = False
    forward_stream: Any = None


@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_batch_spans` did: the plans it advanced (``touched``; some may have
    ended), the span heads it recomputed (``recomputed``), the copy's seconds (None: nothing was
    copied)."""

    touched: tuple[RequestReuse, ...] = ()
    recomputed: int = 0
    copy_seconds: float | None = None


@dataclass
class _RequestLoad:
    """One request's share of a batch's copy."""

    index: int
    req: Any
    state: RequestReuse
    lo: int
    hi: int
    pieces: list[tuple[Span, Hashable]]
    copied: list[tuple[Span, Hashable]] = field(default_factory=list)
    missed: str | None = None
    """Why a donor's spans were not copied (the first such reason)."""


def load_batch_spans(params: LoadParams) -> LoadResult:
    """Copy the reused spans of ``params.batch`` (after ``prepare_for_extend``) and make its
    extend sparse; with ``check``, a plan whose strategy selects at a check layer keeps its
    check sample's copied positions computed, as the batch's check candidates
    (:class:`.batch_state.BatchReuse`). A span whose donor KV is not on the device
    (``match_donor``) is computed instead. Each plan advances through its own transitions
    (loaded, skipped; at its last chunk complete or decline); the caller drops the plans that
    ended.

    With ``peers`` the caller calls this for *every* prefill batch, planned or not, and the copy
    outcome is agreed across the ranks before the batch changes; an error in the copy is then
    raised only after that agreement (so that no rank waits on this one), and every rank
    computes the positions it would have reused. Raises only with the batch unchanged (the
    caller turns it into a cold fallback)."""
    batch, peers = params.batch, params.peers
    loads: list[_RequestLoad] = []
    failure: Exception | None = None
    seconds: float | None = None
    try:
        loads = _collect(params)
        if loads:
            seconds = _match_and_copy(params, loads)
    except Exception as exc:
        if not peers:
            raise
        failure = exc
        seconds = None
        for load in loads:
            load.copied.clear()
    if peers:
        _agree(peers, batch, loads)
    if failure is not None:
        raise failure
    if not loads:
        return LoadResult()
    checked = {load.index for load in loads if params.check and load.state.checks_at_layer}
    _record_candidates(batch, loads, checked)
    recomputed = sum(
        _advance(load, deferred=load.index in checked and bool(load.copied)) for load in loads
    )
    return LoadResult(tuple(load.state for load in loads), recomputed, seconds)


def _match_and_copy(params: LoadParams, loads: list[_RequestLoad]) -> float | None:
    """Find each load's donors and copy their spans (all in one kernel launch, ordered after
    the engine's forward stream); fills ``load.copied`` and ``load.missed``. Donors are locked
    for the copy only. Returns the copy's seconds (None: nothing was copied). Raises before the
    copy with nothing copied."""
    cache, view = params.cache, params.view
    receipts: list[Any] = []
    src_parts: list[torch.Tensor] = []
    dst_parts: list[torch.Tensor] = []
    delta_parts: list[torch.Tensor] = []
    rows = cache.req_to_token_pool.req_to_token
    try:
        for load in loads:
            row = rows[view.row_of(load.req)]
            by_donor: dict[Hashable, list[Span]] = {}
            for span, donor in load.pieces:
                by_donor.setdefault(donor, []).append(span)
            for donor, spans in by_donor.items():
                donor_end = max(s.donor_end for s in spans)
                match = params.donors.match(
                    DonorMatchParams(cache, load.state.namespace, donor, donor_end)
                )
                found = match.slots
                if found is None:
                    load.missed = load.missed or match.reason or Reason.DONOR_EVICTED
                    continue  # these spans are computed instead
                if found.node is not None:
                    receipts.append(view.lock(cache, found.node))
                for s in spans:
                    src = found.path[s.donor_start : s.donor_end].to(torch.int64)
                    if int(src.numel()) != s.length or bool((src < 0).any()):
                        load.missed = load.missed or Reason.DONOR_EVICTED
                        continue  # part of this span's donor KV left the device
                    src_parts.append(src)
                    dst_parts.append(row[s.target_start : s.target_end].to(torch.int64))
                    delta_parts.append(torch.full((s.length,), s.delta, dtype=torch.int64))
                    load.copied.append((s, donor))
        if not src_parts:
            return None
        started = time.perf_counter()
        _copy(cache, src_parts, dst_parts, delta_parts, params.spec, params.forward_stream)
        return time.perf_counter() - started
    finally:
        for receipt in receipts:
            view.unlock(cache, receipt)


def _agree(peers: list[Any], batch: Any, loads: list[_RequestLoad]) -> None:
    """Keep in each load's ``copied`` only the positions every rank copied (sub-spans of its
    pieces); a load that lost any is marked ``rank_disagreement``."""
    starts = [0, *itertools.accumulate(int(ext) for ext in batch.extend_lens)]
    mask = torch.zeros(starts[-1], dtype=torch.bool)
    for load in loads:
        base = starts[load.index] - load.lo
        for span, _ in load.copied:
            mask[base + span.target_start : base + span.target_end] = True
    agreed = rank_agreement.agree_on_copied(peers, mask, any(load.copied for load in loads))
    for load in loads:
        base = starts[load.index] - load.lo
        kept: list[tuple[Span, Hashable]] = []
        for span, donor in load.copied:
            ok = agreed[base + span.target_start : base + span.target_end]
            for a, b in _runs(ok):
                kept.append((Span(span.target_start + a, span.donor_start + a, b - a), donor))
        if sum(s.length for s, _ in kept) < sum(s.length for s, _ in load.copied):
            load.missed = load.missed or Reason.RANK_DISAGREEMENT
        load.copied = kept


def _runs(flags: torch.Tensor) -> list[tuple[int, int]]:
    """The maximal runs [a, b) of True in a 1-D bool tensor."""
    padded = torch.cat(
        [torch.zeros(1, dtype=torch.int8), flags.to(torch.int8), torch.zeros(1, dtype=torch.int8)]
    )
    edges = torch.nonzero(padded[1:] - padded[:-1]).flatten().tolist()
    return list(zip(edges[0::2], edges[1::2], strict=True))


def _collect(params: LoadParams) -> list[_RequestLoad]:
    """The batch's requests with an open plan, with the parts of their spans in this chunk (a
    request the sparse extend cannot take is declined here)."""
    batch = params.batch
    loads: list[_RequestLoad] = []
    for i, req in enumerate(batch.reqs):
        state = params.states.get(req.rid)
        if state is None or not state.open:
            continue
        lo, hi = int(batch.prefix_lens[i]), params.view.extend_end(req)
        reason = sparse_extend_refusal(req)
        if reason is not None:
            state.decline(reason)
            continue
        # the chunk's last position is computed, and so is every position whose input-token
        # logprob is asked for (sglang reads those as the tail of the request's computed tokens)
        limit = hi - 1
        if batch.return_logprob and req.return_logprob:
            limit = min(limit, lo + int(batch.extend_logprob_start_lens[i]))
        pieces = state.pieces_within(lo, limit)
        loads.append(_RequestLoad(i, req, state, lo, hi, pieces))
    return loads


def _copy(
    cache: Any,
    src_parts: list[torch.Tensor],
    dst_parts: list[torch.Tensor],
    delta_parts: list[torch.Tensor],
    spec: Any,
    forward_stream: Any = None,
) -> None:
    from semblend_sglang.kernels import transfer_kv_sglang

    pool = cache.token_to_kv_pool_allocator.get_kvcache()
    device = pool.k_buffer[0].device
    src = torch.cat(src_parts).to(device)
    dst = torch.cat(dst_parts).to(device)
    deltas = torch.cat(delta_parts).to(device)
    if dst.is_cuda:
        wait_for_forward(forward_stream, dst.device)
    transfer_kv_sglang(pool.k_buffer, pool.v_buffer, src, dst, deltas, spec)
    if dst.is_cuda:
        torch.cuda.current_stream(dst.device).synchronize()


def wait_for_forward(forward_stream: Any, device: torch.device) -> None:
    """Order the copy after everything the engine queued on ``forward_stream`` (with overlap
    scheduling the previous batch's forward may still be writing a donor's KV, or reading
    slots sglang freed and handed to this batch): the current stream of ``device`` waits for
    it on the device, without blocking the host. No-op for None or the current stream."""
    if forward_stream is None:
        return
    current = torch.cuda.current_stream(device)
    if forward_stream != current:
        current.wait_stream(forward_stream)


def _computed_mask(load: _RequestLoad) -> torch.Tensor:
    """Over the load's chunk positions ``lo..hi``: True where the pass computes, False where
    it copied donor KV."""
    mask = torch.ones(load.hi - load.lo, dtype=torch.bool)
    for span, _ in load.copied:
        mask[span.target_start - load.lo : span.target_end - load.lo] = False
    return mask


def _sparsify(batch: Any, masks: dict[int, tuple[_RequestLoad, torch.Tensor]]) -> None:
    """Drop from the batch's computed tokens the chunk positions of each load whose mask
    (``masks``: request index -> (load, mask over ``lo..hi``)) is False; keep the true
    positions of the rest. A load that copied nothing, or whose mask drops nothing, is left
    dense."""
    copied = {i: (ld, m) for i, (ld, m) in masks.items() if ld.copied and not bool(m.all())}
    if not copied:
        return
    old = [int(n) for n in batch.extend_lens]
    ext = list(old)
    keep = torch.ones(int(batch.prefill_input_ids_cpu.numel()), dtype=torch.bool)
    sparse = own_batch_reuse(batch).sparse
    start = 0
    for i in range(len(batch.reqs)):
        found = copied.get(i)
        if found is not None:
            load, mask = found
            keep[start : start + old[i]] = mask
            sparse[load.req.rid] = torch.arange(load.lo, load.hi, dtype=torch.int64)[mask]
            ext[i] = int(mask.sum())
        start += old[i]
    batch_fields.keep_scheduled_tokens(batch, keep, ext)


def _record_candidates(batch: Any, loads: list[_RequestLoad], checked: set[int]) -> None:
    """Drop every load's copied positions from the batch's computed tokens, but for the loads
    of ``checked`` (indices) note their sampled copied positions (:func:`_check_sample_mask`)
    as check candidates and keep those computed (a dense reference keeps them all, the others
    as ``pinned``)."""
    masks: dict[int, tuple[_RequestLoad, torch.Tensor]] = {}
    for load in loads:
        if load.index not in checked:
            masks[load.index] = (load, _computed_mask(load))
            continue
        if not load.copied:
            continue
        found = own_batch_reuse(batch).candidates
        config = load.state.settings.config
        copied = ~_computed_mask(load)
        sampled = _check_sample_mask(load, CheckSampling.of(config))
        computed = ~copied | sampled
        if wants_dense_reference(load.req):
            computed = torch.ones_like(copied)
        offsets = torch.nonzero(sampled[computed]).flatten()
        pinned = torch.nonzero((copied & ~sampled)[computed]).flatten()
        final = load.hi >= len(load.req.origin_input_ids)
        spans = len(load.state.plan.spans)
        reused = int(copied.sum())
        found[load.req.rid] = CheckCandidates(offsets, final, reused, pinned, spans, config)
        masks[load.index] = (load, computed)
    _sparsify(batch, masks)


def _check_sample_mask(load: _RequestLoad, sampling: CheckSampling) -> torch.Tensor:
    """Over the load's chunk positions ``lo..hi``: True at the copied positions computed up to
    the check layer (:meth:`~semblend_sglang.recompute.CheckSampling.sample` of each copied
    span)."""
    mask = torch.zeros(load.hi - load.lo, dtype=torch.bool)
    spans = len(load.state.plan.spans)
    for span, _ in load.copied:
        mask[span.target_start - load.lo + sampling.sample(spans, span.length)] = True
    return mask


def _advance(load: _RequestLoad, deferred: bool = False) -> int:
    """Advance the request's plan past this chunk; at its last chunk complete it (or decline it
    when nothing was copied), unless ``deferred`` (the check layer completes it). Returns the
    span heads this chunk recomputed."""
    state = load.state
    recomputed = state.recomputed
    if load.copied:
        state.loaded(load.copied, load.hi)
    else:
        state.skipped(load.hi)
    if load.hi >= len(load.req.origin_input_ids) and not deferred:
        if state.reused_any:
            state.complete()
        else:
            state.decline(load.missed or Reason.SPANS_TRIMMED_AWAY)
    return state.recomputed - recomputed
