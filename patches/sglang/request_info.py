"""What the SGLang hooks read off a request and the running server (every supported version).

Called by the adapters' hooks inside the scheduler process; reads only, never raises for a
request object of a supported sglang version, imports sglang lazily.
"""

from __future__ import annotations

import logging
from typing import Any

from semblend_sglang.config import Config, ConfigError
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason
from semblend_sglang.request_settings import (
    REUSE_PARAM as REUSE_PARAM,
)
from semblend_sglang.request_settings import (
    RequestSettings,
    resolve,
    value_error,
)

logger = logging.getLogger(__name__)

DENSE_REFERENCE_PARAM = "semblend_dense_reference"
"""``custom_params`` key that makes a request run as the dense reference of its selection
(:mod:`.check_layer`): it keeps every copied position in every layer."""

_warned_values: set[str] = set()
_DEFAULTS = Config()


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


def custom_params_of(req: Any) -> dict[str, Any] | None:
    """``req``'s ``sampling_params.custom_params`` when it is a dict, else None."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params if isinstance(params, dict) else None


def reuse_value_error(custom_params: Any) -> str | None:
    """Why ``custom_params`` carries a malformed :data:`REUSE_PARAM` (the key absent or a value
    :func:`~semblend_sglang.request_settings.resolve` takes: None). The request guard answers
    a malformed one with 400."""
    return value_error(custom_params)


def wants_dense_reference(req: Any) -> bool:
    """``req`` asked to run as the dense reference (:data:`DENSE_REFERENCE_PARAM`)."""
    params = custom_params_of(req)
    return params is not None and bool(params.get(DENSE_REFERENCE_PARAM))


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


def reuse_settings(req: Any, server: Config) -> RequestSettings | None:
    """The settings ``req`` is served with on a server configured ``server``
    (:func:`~semblend_sglang.request_settings.resolve` of its :data:`REUSE_PARAM`), or None
    when it opted out. A value ``resolve`` refuses (the request guard answers it with 400 where
    it runs) also opts out (a client that sets the key meant something) and is logged once per
    value. An opted-out request is never planned; it still donates (its KV is a cold
    prefill's). Never raises."""
    params = custom_params_of(req)
    if params is None or REUSE_PARAM not in params:
        return RequestSettings(server)
    try:
        return resolve(params[REUSE_PARAM], server)
    except ConfigError as exc:
        shown = repr(params[REUSE_PARAM])[:80]
        if shown not in _warned_values:
            _warned_values.add(shown)
            logger.warning(
                "semblend: custom_params %s=%s is refused (%s); the request is served without "
                "semantic reuse",
                REUSE_PARAM,
                shown,
                exc,
            )
        return None


def opted_out(req: Any) -> bool:
    """True when ``req`` is served without semantic reuse (:func:`reuse_settings` is None)."""
    return reuse_settings(req, _DEFAULTS) is None
