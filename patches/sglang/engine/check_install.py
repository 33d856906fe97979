"""Whether the served model takes the check-layer hook, and installing it (scheduler start).

:func:`install` wraps the layers (:class:`.check_layer.LayerHook`) of a model of
:data:`KNOWN_MODEL_CLASSES` (decoder layers ``forward(positions, hidden_states, forward_batch,
...)`` returning sglang's residual-stream handle, or a ``(hidden, residual)`` pair); on any other
model, pipeline or attention parallelism, or a check layer outside the model, it logs one line
and refuses (plans are then declined as ``unsupported_model``). It also names, once, the
settings the hook will not use.
"""

from __future__ import annotations

import logging
from typing import Any

from semblend_sglang.plan import Reason

from ..flow.check_layer import LayerHook
from ..flow.engine_facts import CheckReports

logger = logging.getLogger(__name__)

KNOWN_MODEL_CLASSES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
"""Model classes whose decoder layers the hook knows."""

_WRAPPED_ATTR = "_semblend_layer_hook"


def refusal(model_runner: Any, check_layer: int) -> str | None:
    """Why the model of ``model_runner`` cannot take the check-layer hook, or None."""
    model = getattr(model_runner, "model", None)
    name = type(model).__name__
    if name not in KNOWN_MODEL_CLASSES:
        return f"model class {name} is not one the check-layer hook knows"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return f"{name} has no model.layers"
    start = int(getattr(model.model, "start_layer", 0))
    end = int(getattr(model.model, "end_layer", len(layers)))
    if start != 0 or end != len(layers):
        return "pipeline parallelism splits the layers"
    if not 0 <= check_layer < end - 1:
        return f"recompute_check_layer {check_layer} is not below the last layer ({end - 1})"
    server_args = getattr(model_runner, "server_args", None)
    if getattr(server_args, "enable_dp_attention", False):
        return "data-parallel attention"
    for arg in ("tp_size", "attn_cp_size", "dcp_size"):
        if int(getattr(server_args, arg, 1) or 1) > 1:
            return f"--{arg.replace('_', '-')} > 1 (ranks would score different heads)"
    return None


def model_runner_of(scheduler: Any) -> Any:
    """The model runner of a scheduler (``tp_worker.model_runner``, or the legacy
    ``tp_worker.worker.model_runner``), or None."""
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        runner = getattr(getattr(worker, "worker", None), "model_runner", None)
    return runner


def install(flow: CheckReports, model_runner: Any) -> LayerHook | None:
    """Scheduler start: wrap the served model's layers and return the hook (a model wrapped
    already reports to ``flow`` from now on), whatever the server's strategy, since a request
    may choose one that selects at a check layer. On a model this seam does not take, one line
    names why (a warning where the server's own strategy needs the hook) and None is returned.
    The caller hands the result to the flow (:class:`.engine_facts.EngineFacts`)."""
    config = flow.config
    model = getattr(model_runner, "model", None)
    if model is not None and getattr(model, _WRAPPED_ATTR, None) is not None:
        hook: LayerHook = getattr(model, _WRAPPED_ATTR)
        hook.flow = flow
        return hook
    reason = refusal(model_runner, int(config.recompute_check_layer))
    if reason is None:
        try:
            hook = LayerHook(flow, model_runner)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        strategy = config.recompute_strategy
        log = logger.warning if strategy.uses_check_layer else logger.info
        log(
            "semblend: the check-layer hook refuses this model (%s): every plan whose "
            "recompute_strategy selects at a check layer (deviation, query; the server's: %s) "
            "is declined as %s",
            reason,
            strategy,
            Reason.UNSUPPORTED_MODEL,
        )
        return None
    object.__setattr__(model, _WRAPPED_ATTR, hook)
    if config.recompute_recheck_depth > 0.0 and hook.recheck_layer is None:
        logger.warning(
            "semblend: recompute_recheck_depth=%s puts the second check at layer %d, not after "
            "recompute_check_layer=%d and before the last layer (%d): plans are checked once",
            config.recompute_recheck_depth,
            round(config.recompute_recheck_depth * (hook.last_layer + 1)),
            hook.check_layer,
            hook.last_layer,
        )
    elif hook.recheck_layer is not None:
        logger.info(
            "semblend: plans of more than %d spans are checked again at layer %d of %d",
            config.recompute_check_max_spans,
            hook.recheck_layer,
            hook.last_layer + 1,
        )
    if config.quality_gate > 0.0 and config.recompute_check_share < 1.0:
        logger.warning(
            "semblend: quality_gate is set, so every plan is checked on all its reused "
            "positions (recompute_check_share=%s is not used)",
            config.recompute_check_share,
        )
    return hook
