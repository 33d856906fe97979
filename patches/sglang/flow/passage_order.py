"""Passage order at a request's arrival (opt-in per request, :mod:`semblend_sglang.passages`).

The unified adapter's ``Scheduler._add_request_to_queue`` hook calls :func:`reorder_request`
for every arriving request before it is queued, so that SGLang's own prefix match, and
semblend's plan for what the order leaves, see the prompt in the chosen order. The order the
model saw goes back to the client in ``meta_info`` under
:data:`~semblend_sglang.passages.ORDER_INFO_KEY`, through SGLang's per-request
``customized_info`` (a request-level key: :func:`request_level_key_wrappers`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from semblend_sglang.locate import LocateParams, SpanSource
from semblend_sglang.namespace import Namespace
from semblend_sglang.passages import (
    ORDER_INFO_KEY,
    PASSAGES_PARAM,
    PassageError,
    choose_order,
    parse_passages,
    reordered_prompt,
)

from ..request_info import custom_params_of, namespace_for, opted_out
from ..wrapping import Wrappers
from .request_flow import RequestFlow

CachedLen = Callable[[Any, Namespace], int]
"""``cached_len(tokens, namespace)``: tokens of ``tokens`` the exact cache holds."""


def declared_passages(req: Any) -> Any:
    """The :data:`~semblend_sglang.passages.PASSAGES_PARAM` value ``req`` sent, or None."""
    params = custom_params_of(req)
    return None if params is None else params.get(PASSAGES_PARAM)


def reorder_request(flow: RequestFlow, req: Any, cached_len: CachedLen, page_size: int) -> None:
    """Put the declared passages of ``req`` in :func:`~semblend_sglang.passages.choose_order`'s
    order: ``origin_input_ids`` (and ``origin_input_ids_unpadded``, ``full_untruncated_fill_ids``)
    rewritten in place, the same length; the order recorded in ``req.customized_info`` and
    counted (:meth:`.runtime.SemblendRuntime.count_passage_order`). Passages after the exact
    run are put in donor runs (``SemanticProvider.locate`` of the request as sent) unless
    semantic reuse will not serve the request (refused options, disabled, substitute mode, the
    request opted out). Nothing for a request without the key. Left as sent, counted
    ``declined``: a malformed declaration (the request guard refuses one at the tokenizer
    manager; an in-process engine has none) and a request asking for the input logprobs of a
    passage token. May raise; the caller's hook turns that into the request as sent."""
    value = declared_passages(req)
    if value is None:
        return
    runtime = flow.runtime
    tokens = req.origin_input_ids
    try:
        layout = parse_passages(value, len(tokens))
    except PassageError as exc:
        runtime.log_failure("passages", exc)
        runtime.count_passage_order("declined")
        return
    start = int(getattr(req, "logprob_start_len", -1))
    if getattr(req, "return_logprob", False) and 0 <= start < layout.tail_start:
        runtime.count_passage_order("declined")
        _report(req, tuple(range(len(layout.bounds))))
        return
    namespace = namespace_for(req)

    def sources() -> tuple[SpanSource | None, ...]:
        asked = LocateParams(namespace, tokens, layout.bounds)
        return runtime.provider.locate(asked).sources

    config = runtime.config
    reuses = (
        runtime.active and config.enabled and config.mode != "substitute" and not opted_out(req)
    )
    chosen = choose_order(
        tokens,
        layout,
        lambda t: cached_len(t, namespace),
        page_size,
        sources if reuses else None,
    )
    if chosen.changed:
        prompt = array("q", reordered_prompt(tokens, layout, chosen.order))
        if req.origin_input_ids_unpadded is req.origin_input_ids:
            req.origin_input_ids_unpadded = prompt
        req.origin_input_ids = prompt
        req.full_untruncated_fill_ids = prompt + array("q", req.output_ids)
    runtime.count_passage_order(
        "reordered" if chosen.changed else "kept", chosen.held_tokens, chosen.joins
    )
    _report(req, chosen.order)


def _report(req: Any, order: tuple[int, ...]) -> None:
    info = getattr(req, "customized_info", None)
    if not isinstance(info, dict):
        info = {}
        req.customized_info = info
    info[ORDER_INFO_KEY] = list(order)


def request_level_key_wrappers(streamer: type) -> Wrappers:
    """The wrapper of ``streamer.is_request_level_customized_info_key`` (sglang's
    ``SchedulerOutputStreamer``) that makes :data:`~semblend_sglang.passages.ORDER_INFO_KEY`
    a request-level key: sent once, whole (with the first streamed chunk, or when a request
    ends), instead of sliced per output token. Empty where the streamer has no such method."""
    original = getattr(streamer, "is_request_level_customized_info_key", None)
    if original is None:
        return {}

    def is_request_level_customized_info_key(self: Any, key: str) -> bool:
        return key == ORDER_INFO_KEY or bool(original(self, key))

    return {
        (streamer, "is_request_level_customized_info_key"): is_request_level_customized_info_key
    }
