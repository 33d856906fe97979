"""What the SGLang hooks read off a request and the running server (every supported version).

Called by the adapters' hooks inside the scheduler process; reads only, never raises for a
request object of a supported sglang version, imports sglang lazily.
"""

from __future__ import annotations

import logging
from typing import Any

from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason

logger = logging.getLogger(__name__)

REUSE_PARAM = "semblend_reuse"
"""The ``custom_params`` key (``sampling_params.custom_params`` of ``/generate``; ``extra_body=
{"custom_params": ...}`` of the OpenAI-compatible API) by which a request opts out of semantic
reuse: ``false`` or ``"off"``. ``true``, ``"on"`` or no key: the server's setting."""

DENSE_REFERENCE_PARAM = "semblend_dense_reference"
"""``custom_params`` key that makes a request run as the dense reference of its selection
(:mod:`.check_layer`): it keeps every copied position in every layer."""

_REUSE_ON = (True, "on")
_REUSE_OFF = (False, "off")
_warned_values: set[str] = set()


def server_args() -> Any:
    """The scheduler's ``ServerArgs``, or None outside an SGLang process."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:
        return None


def served_model_path() -> str | None:
    """The served model's path (for its config.json), or None outside a server."""
    path = getattr(server_args(), "model_path", None)
    return None if path is None else str(path)


def served_tokenizer_path() -> str | None:
    """The running server's tokenizer (or model) path, None outside a server."""
    args = server_args()
    path = getattr(args, "tokenizer_path", None) or getattr(args, "model_path", None)
    return None if path is None else str(path)


def namespace_for(req: Any) -> Namespace:
    """The reuse namespace of ``req``: served model, tokenizer, LoRA adapter, extra_key and
    cache_salt (a version whose ``Req`` has no ``cache_salt`` folds it into ``extra_key``)."""
    args = server_args()
    model = str(getattr(args, "served_model_name", None) or getattr(args, "model_path", "") or "")
    tokenizer = str(getattr(args, "tokenizer_path", None) or getattr(args, "model_path", "") or "")
    return Namespace(
        model=model,
        tokenizer_fingerprint=tokenizer,
        adapter=getattr(req, "lora_id", None),
        extra_key=getattr(req, "extra_key", None),
        cache_salt=getattr(req, "cache_salt", None),
    )


def eligible(req: Any) -> bool:
    """False for requests whose KV is not a function of their token ids alone (multimodal,
    positional overrides, streaming sessions, diffusion LLMs): never planned, never donors."""
    return (
        getattr(req, "multimodal_inputs", None) is None
        and getattr(req, "positional_embed_overrides", None) is None
        and getattr(req, "session", None) is None
        and not (hasattr(req, "is_dllm") and req.is_dllm())
    )


def _reuse_value(value: Any) -> bool | None:
    """True for ``true``/``"on"``, False for ``false``/``"off"``, None for any other value."""
    if any(value is v or (isinstance(v, str) and value == v) for v in _REUSE_ON):
        return True
    if any(value is v or (isinstance(v, str) and value == v) for v in _REUSE_OFF):
        return False
    return None


def reuse_value_error(custom_params: Any) -> str | None:
    """Why ``custom_params`` carries a malformed :data:`REUSE_PARAM`, or None (key absent, or
    one of true, false, "on", "off"). The request guard answers a malformed one with 400."""
    if not isinstance(custom_params, dict) or REUSE_PARAM not in custom_params:
        return None
    value = custom_params[REUSE_PARAM]
    if _reuse_value(value) is not None:
        return None
    return (
        f'custom_params {REUSE_PARAM} must be true, false, "on" or "off"; got {repr(value)[:80]}.'
    )


def wants_dense_reference(req: Any) -> bool:
    """``req`` asked to run as the dense reference (:data:`DENSE_REFERENCE_PARAM`)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(params, dict) and bool(params.get(DENSE_REFERENCE_PARAM))


def sparse_extend_refusal(req: Any) -> str | None:
    """Why ``req`` cannot take a sparse extend (input embeddings, multimodal inputs, positional
    embedding overrides: ``unsupported_cache``), or None."""
    if (
        req.input_embeds is not None
        or req.multimodal_inputs is not None
        or req.positional_embed_overrides is not None
    ):
        return Reason.UNSUPPORTED_CACHE
    return None


def asks_input_logprobs(req: Any) -> bool:
    """Whether ``req`` asks for the logprob of any prompt token before its last: SGLang sets
    ``logprob_start_len`` to the prompt's length (or -1) for output-token logprobs alone."""
    if not getattr(req, "return_logprob", False):
        return False
    start = getattr(req, "logprob_start_len", None)
    return start is not None and 0 <= int(start) < len(req.origin_input_ids) - 1


def opted_out(req: Any) -> bool:
    """True when ``req`` asked for no semantic reuse (:data:`REUSE_PARAM` is ``false`` or
    ``"off"``). Any other value than those and ``true``/``"on"`` (which the request guard
    refuses with 400 where it runs) also opts out (a client that sets the key meant something)
    and is logged once per value. An opted-out request is never planned; it still donates (its
    KV is a cold prefill's). Never raises."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(params, dict) or REUSE_PARAM not in params:
        return False
    value = _reuse_value(params[REUSE_PARAM])
    if value is None:
        shown = repr(params[REUSE_PARAM])[:80]
        if shown not in _warned_values:
            _warned_values.add(shown)
            logger.warning(
                'semblend: custom_params %s=%s is not one of true, false, "on", "off"; '
                "the request is served without semantic reuse",
                REUSE_PARAM,
                shown,
            )
        return True
    return not value
