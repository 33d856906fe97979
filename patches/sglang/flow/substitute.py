"""Substitute mode (opt-in, output-changing): rewrite an arriving request's head to its donor's.

For the plan's first span [a, b) <- donor D [a0, b0) the prompt T becomes ``D[:a0] + T[a:]``, so
SGLang's exact prefix cache serves ``D[:b0]`` unchanged: no KV is copied and nothing approximate
exists; the model sees the donor's head instead of the request's own. Both adapters call
:func:`substitute_request` from their ``Scheduler._add_request_to_queue`` hook, after checking
that the scheduler's tree is one they serve.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason, ReusePlan

from ..request_info import eligible, namespace_for, opted_out
from .request_flow import RequestFlow

CachedLen = Callable[[Any, Namespace], int]
"""``cached_len(tokens, namespace)``: tokens of ``tokens`` the exact cache holds (device and
host), read through the tree's original ``match_prefix``."""


def substituted_prompt(tokens: Any, donor: Any, plan: ReusePlan) -> array | None:
    """Substitute mode's rewritten prompt: ``donor[:a0] + tokens[a:]`` for the plan's first span
    [a, b) <- [a0, b0) (so the new prompt starts with ``donor[:b0]``), as an ``array("q")``.

    None when the donor's tokens are gone or do not match the span (the donor was dropped).
    """
    span = plan.spans[0]
    if donor is None or len(donor) < span.donor_start + span.length:
        return None
    head = [int(t) for t in donor[: span.donor_start]]
    same = donor[span.donor_start : span.donor_start + span.length]
    tail = tokens[span.target_start :]
    if [int(t) for t in same] != [int(t) for t in tail[: span.length]]:
        return None
    return array("q", head) + array("q", tail)


def substitute_request(
    flow: RequestFlow, scheduler: Any, req: Any, cache: Any, cached_len: CachedLen
) -> None:
    """Look ``req`` up and, for a plan, rewrite its prompt in place (``origin_input_ids``,
    ``full_untruncated_fill_ids``, ``logprob_start_len`` shifted with it).

    Records the request's outcome: materialized (with the tokens the exact cache will serve
    beyond its own exact hit) or declined: ``donor_evicted`` (the donor's tokens or KV are gone;
    the donor is forgotten) or ``engine_declined`` (the rewrite would not fit the context, or input
    logprobs were asked for over the replaced head). A request it decides on is marked decided, so
    the match hooks leave it alone. May raise; the caller's hook turns that into a cold fallback.
    """
    rid = req.rid
    runtime = flow.runtime
    outcomes = runtime.provider
    if not runtime.config.enabled or not eligible(req) or flow.is_tracked(rid):
        return
    if opted_out(req):
        flow.opt_out(rid)
        return
    tokens = req.origin_input_ids
    namespace = namespace_for(req)
    exact_len = cached_len(tokens, namespace)
    decision = runtime.lookup(LookupParams(namespace, tokens, exact_len, rid, int(cache.page_size)))
    if decision.kind != "plan" or decision.plan is None:
        return
    flow.decided_at_arrival(rid)  # the match hooks leave it alone
    plan = decision.plan
    donor = flow.donors.tokens(plan.donor_handle)
    new_prompt = substituted_prompt(tokens, donor, plan)
    if new_prompt is None:
        flow.donors.forget(plan.donor_handle)
        outcomes.record_declined(rid, Reason.DONOR_EVICTED)
        return
    max_new = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None) or 0
    context_len = int(getattr(scheduler.model_config, "context_len", 0) or 0)
    if len(new_prompt) >= int(scheduler.max_req_input_len) or (
        context_len and len(new_prompt) + int(max_new) > context_len
    ):
        outcomes.record_declined(rid, Reason.ENGINE_DECLINED)
        return
    span = plan.spans[0]
    shift = span.donor_start - span.target_start
    logprob_start = int(getattr(req, "logprob_start_len", -1))
    if getattr(req, "return_logprob", False) and 0 <= logprob_start < span.target_start:
        # Input logprobs over the replaced head would score the donor's tokens.
        outcomes.record_declined(rid, Reason.ENGINE_DECLINED)
        return
    served = cached_len(new_prompt, namespace)
    if served < span.donor_start + span.length:
        flow.donors.forget(plan.donor_handle)  # its KV left the tree
        outcomes.record_declined(rid, Reason.DONOR_EVICTED)
        return
    if req.origin_input_ids_unpadded is req.origin_input_ids:
        req.origin_input_ids_unpadded = new_prompt
    req.origin_input_ids = new_prompt
    req.full_untruncated_fill_ids = new_prompt + req.output_ids
    if logprob_start >= 0:
        req.logprob_start_len = logprob_start + shift  # same tokens, new positions
    outcomes.record_materialized(rid, max(0, served - exact_len))
