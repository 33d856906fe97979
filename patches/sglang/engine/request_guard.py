"""Refuse prompts that would crash SGLang's scheduler, with a reason, before they are computed.

SGLang 0.5.23 checks a prompt's length but not its tokens: a text that tokenizes to nothing
(``{"text": ""}``) reaches the model as a 0-token forward and a token id outside the
vocabulary (negative, or >= the embedding's rows) reaches the embedding lookup; a
``top_logprobs_num`` larger than the vocabulary reaches ``topk`` over the logits. Each raises
in the scheduler, which then takes the whole server down (docs/sglang.md, "Bad input"). The
guard checks a request at two seams, with one rule (:func:`request_error`):

- the tokenizer manager's ``_validate_one_request`` (HTTP server process, right after
  tokenization): a bad prompt raises ``ValueError``, which SGLang answers with 400 and the
  message, before anything reaches the scheduler; a malformed ``semblend_reuse`` value or
  ``semblend_passages`` declaration is refused here too
  (:func:`.request_info.reuse_value_error`, :func:`semblend_sglang.passages.passages_error`);
- the scheduler's ``validate_input_length`` (every request the scheduler receives, also those
  that bypass the tokenizer manager, such as SMG's gRPC mode): a bad prompt becomes SGLang's
  own abort with the message (400), as a prompt over the length limit does.

The plugin installs it in every sglang process whatever ``SEMBLEND_ENABLED`` says (the crash
is SGLang's, not reuse's); ``SEMBLEND_REQUEST_GUARD=0`` leaves SGLang's own checks alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from semblend_sglang.config_fields import parse_flag
from semblend_sglang.passages import passages_error

from ..after_import import call_after_import
from ..request_info import reuse_value_error
from ..wrapping import Originals, install_wrappers, restore

logger = logging.getLogger(__name__)

REQUEST_GUARD_ENV = "SEMBLEND_REQUEST_GUARD"
"""Environment switch of the guard: on unless 0/false/no/off."""

TOKENIZER_MANAGER_MODULE = "sglang.srt.managers.tokenizer_manager"
"""Module of SGLang's ``TokenizerManager`` (the HTTP server's process, and in-process engines)."""

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
"""Module of SGLang's ``Scheduler``; it calls ``validate_input_length`` by this module's name."""

_registered: set[str] = set()
"""Seams whose install hook is registered (run now or at their module's import)."""

_restore: dict[str, Originals] = {}
"""What :func:`.wrapping.restore` puts back for each seam the guard wrapped, by seam name."""


def prompt_error(input_ids: Sequence[int] | None, vocab_size: int | None) -> str | None:
    """Why a model must not compute the prompt ``input_ids``, or None when it may.

    A prompt needs at least one token, and every id in ``[0, vocab_size)`` (not checked when
    ``vocab_size`` is None). ``None`` ids (input embeddings instead) are not checked. Pure; both
    seams call it.
    """
    if input_ids is None:
        return None
    if len(input_ids) == 0:
        return (
            "The prompt has no tokens (the text is empty or tokenizes to nothing); "
            "send at least one token."
        )
    if vocab_size is None:
        return None
    low, high = min(input_ids), max(input_ids)
    if low >= 0 and high < vocab_size:
        return None
    position, token = next((i, t) for i, t in enumerate(input_ids) if not 0 <= t < vocab_size)
    return (
        f"Token id {token} at position {position} is outside the model's vocabulary "
        f"(ids 0 to {vocab_size - 1})."
    )


def top_logprobs_error(
    return_logprob: Any, top_logprobs_num: Any, vocab_size: int | None
) -> str | None:
    """Why a request's ``top_logprobs_num`` cannot be served (more than the vocabulary: SGLang
    would take ``topk`` of more columns than the logits have), or None. Checked only when the
    request returns log-probabilities. Pure."""
    if not return_logprob or vocab_size is None or not isinstance(top_logprobs_num, int):
        return None
    if top_logprobs_num <= vocab_size:
        return None
    return (
        f"top_logprobs_num {top_logprobs_num} is more than the model's vocabulary "
        f"({vocab_size} tokens)."
    )


def request_error(
    input_ids: Sequence[int] | None,
    vocab_size: int | None,
    return_logprob: Any = False,
    top_logprobs_num: Any = 0,
) -> str | None:
    """The first of :func:`prompt_error` and :func:`top_logprobs_error`: why SGLang must not
    compute this request, or None. Both seams call it."""
    return prompt_error(input_ids, vocab_size) or top_logprobs_error(
        return_logprob, top_logprobs_num, vocab_size
    )


def _request_error(obj: Any, input_ids: Sequence[int] | None, vocab_size: int | None) -> str | None:
    """:func:`request_error` for one tokenized request object of the tokenizer manager,
    skipping the prompt check where SGLang fills the prompt in later (multimodal placeholders,
    input embeddings, a session's history), then the ``semblend_reuse`` value and the declared
    passages (against the tokenized prompt's length)."""
    multimodal = getattr(obj, "contains_mm_input", None)
    checked_ids: Sequence[int] | None = input_ids
    session = getattr(obj, "session_params", None)
    in_session = isinstance(session, dict) and bool(session.get("id"))
    if getattr(obj, "input_embeds", None) is not None or (callable(multimodal) and multimodal()):
        checked_ids = None
    elif in_session and input_ids is not None and len(input_ids) == 0:
        checked_ids = None
    error = request_error(
        checked_ids,
        vocab_size,
        getattr(obj, "return_logprob", False),
        getattr(obj, "top_logprobs_num", 0),
    )
    if error is not None:
        return error
    sampling = getattr(obj, "sampling_params", None)
    custom = sampling.get("custom_params") if isinstance(sampling, dict) else None
    return reuse_value_error(custom) or passages_error(
        custom, len(input_ids) if input_ids is not None else 0
    )


def _guard_tokenizer_manager(module: ModuleType) -> None:
    """Wrap ``TokenizerManager._validate_one_request``: a bad request raises ValueError (400)."""
    owner = module.TokenizerManager
    original = owner._validate_one_request

    def _validate_one_request(self: Any, obj: Any, input_ids: Any) -> None:
        vocab_size = getattr(getattr(self, "model_config", None), "vocab_size", None)
        error = _request_error(obj, input_ids, vocab_size)
        if error is not None:
            raise ValueError(error)
        original(self, obj, input_ids)

    _restore["tokenizer_manager"] = install_wrappers(
        {(owner, "_validate_one_request"): _validate_one_request}
    )


def _guard_scheduler(module: ModuleType) -> None:
    """Wrap the scheduler's ``validate_input_length``: a bad request becomes SGLang's abort."""
    original = module.validate_input_length

    def validate_input_length(req: Any, *args: Any, **kwargs: Any) -> str | None:
        plain = (
            getattr(req, "multimodal_inputs", None) is None
            and getattr(req, "input_embeds", None) is None
        )
        error = request_error(
            req.origin_input_ids if plain else None,
            getattr(req, "vocab_size", None),
            getattr(req, "return_logprob", False),
            _top_logprobs_num(req),
        )
        if error is not None:
            return error
        result: str | None = original(req, *args, **kwargs)
        return result

    _restore["scheduler"] = install_wrappers(
        {(module, "validate_input_length"): validate_input_length}
    )


def _top_logprobs_num(req: Any) -> Any:
    """A scheduler ``Req``'s ``top_logprobs_num`` (0.5.23 keeps it in ``req.logprob``, earlier
    versions on the request)."""
    logprob = getattr(req, "logprob", None)
    if logprob is not None and hasattr(logprob, "top_logprobs_num"):
        return logprob.top_logprobs_num
    return getattr(req, "top_logprobs_num", 0)


def _guarded(install: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    """``install`` that logs and leaves SGLang unchanged instead of raising (it runs inside
    the import of an SGLang module)."""

    def hook(module: ModuleType) -> None:
        try:
            install(module)
        except Exception as exc:
            logger.error(
                "semblend: request guard not installed in %s (%s: %s)",
                module.__name__,
                type(exc).__name__,
                exc,
            )

    return hook


def install_request_guard(environ: Mapping[str, str] | None = None) -> bool:
    """Plugin hook: guard the tokenizer manager and the scheduler of this process, now or when
    their modules are imported. Idempotent; returns False when ``SEMBLEND_REQUEST_GUARD`` turns
    it off. Never raises (a failure is logged once and leaves SGLang unchanged)."""
    env = os.environ if environ is None else environ
    if parse_flag(env.get(REQUEST_GUARD_ENV)) is False:
        return False
    for seam, module, install in (
        ("tokenizer_manager", TOKENIZER_MANAGER_MODULE, _guard_tokenizer_manager),
        ("scheduler", SCHEDULER_MODULE, _guard_scheduler),
    ):
        if seam not in _registered:
            _registered.add(seam)
            call_after_import(module, _guarded(install))
    return True


def remove_request_guard() -> None:
    """Put back every seam the guard wrapped in this process (tests; idempotent). A seam whose
    module is not imported yet is guarded when it is, unless removed again after."""
    for seam in list(_restore):
        restore(_restore.pop(seam))
        _registered.discard(seam)
