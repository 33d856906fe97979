"""Admission credit: how SGLang's ``PrefillAdder`` budgets a prefill chunk that reuses KV.

The adder charges a chunk every position it extends; a chunk of a planned request computes
fewer (its copied positions are skipped after the check layer, or everywhere without one). The
version adapter's wrapper of ``PrefillAdder.add_one_req`` raises the adder's compute budgets by
:func:`admission_credit` before it admits and takes back :func:`admission_charge` after, so
the adder admits the chunk it would admit if it knew what the chunk computes. The memory budget
still takes every position. Never raises (errors go through :meth:`RequestFlow.guarded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import rank_agreement
from ..flow.request_flow import RequestFlow
from ..request_info import asks_input_logprobs


@dataclass(frozen=True)
class AdmissionCredit:
    """A receipt of :func:`admission_credit`: the ``tokens`` the adder's compute budgets were
    raised by while it admits ``req`` from position ``lo``, agreed with ``peers``;
    :func:`admission_charge` takes it."""

    req: Any
    lo: int
    tokens: int = 0
    peers: list[Any] = field(default_factory=list)


def admission_credit(
    flow: RequestFlow, cache: Any, req: Any, budget: int | None
) -> AdmissionCredit:
    """Before SGLang's ``PrefillAdder`` admits a prefill chunk of ``req`` from its
    ``prefix_len`` with ``budget`` tokens of compute left (its ``rem_chunk_tokens``): the
    tokens its compute budgets are raised by while it admits, the reused positions the longest
    chunk that computes at most ``budget`` positions would skip (where other ranks run
    ``cache``'s batches, the least any rank gives). A plan whose strategy selects at a check
    layer is charged the ``recompute_ratio`` of the copied positions it recomputes after its
    check layer (the layers up to it run every position). 0 without an open plan or a chunk
    budget, or when input-token logprobs are asked for (output-token logprobs alone change
    nothing). The adapter takes back :func:`admission_charge`."""
    rid = getattr(req, "rid", None)
    lo = int(getattr(req, "prefix_len", 0) or 0)
    peers = flow.guarded("admission", None, [], flow.view.peers, cache)
    tokens = flow.guarded("admission", rid, 0, _skipped, flow, req, lo, budget)
    if peers:
        tokens = rank_agreement.agree_min(peers, tokens)
    return AdmissionCredit(req, lo, tokens, peers)


def admission_charge(flow: RequestFlow, credit: AdmissionCredit, admitted: bool) -> int:
    """After the adder ran with ``credit``: the part of it the admitted chunk [lo, extend_end)
    did not skip, to take back from its budgets (all of it when ``req`` was not
    ``admitted``)."""
    req = credit.req
    taken = 0
    if admitted:
        hi = int(getattr(req, "extend_end", credit.lo) or credit.lo)
        taken = flow.guarded("admission", req.rid, 0, _skipped, flow, req, credit.lo, None, hi)
    if credit.peers:
        taken = rank_agreement.agree_min(credit.peers, taken)
    return credit.tokens - taken


def _skipped(
    flow: RequestFlow, req: Any, lo: int, budget: int | None, hi: int | None = None
) -> int:
    """Reused positions of ``req``'s open plan in the chunk [lo, hi) (without ``hi``: the
    longest one that computes at most ``budget`` positions) that no layer after the check layer
    computes."""
    state = flow.requests.get(req.rid)
    if state is None or not state.open or asks_input_logprobs(req):
        return 0
    ratio = float(state.settings.config.recompute_ratio)
    kept = 1.0 - ratio if flow.selects_at_check_layer(state) else 1.0
    if hi is None:
        if budget is None or budget <= 0:
            return 0
        hi = state.chunk_end(lo, len(req.full_untruncated_fill_ids), int(budget), kept)
    return 0 if hi <= lo else (hi - lo) - state.computed_within(lo, hi, kept)
