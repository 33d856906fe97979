"""Wrappers for scheduler-side methods that every adapter installs the same way.

Each factory takes the original method and returns its replacement for
:func:`~.adapter.install_wrappers`. The wrappers run the original unchanged and never let an
exception of semblend's reach the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import layer_hook
from .http_routes import CONFIG_KEY, STATE_KEY
from .runtime import SemblendRuntime
from .server_options import engine_hf_config, unsupported_options


def wrap_get_internal_state(original: Callable[..., Any], runtime: SemblendRuntime) -> Any:
    """``get_internal_state`` that adds semblend's counters and resolved config to the state
    SGLang's ``/server_info`` returns (read by ``GET /semblend/snapshot``)."""

    def get_internal_state(self: Any, recv_req: Any) -> Any:
        out = original(self, recv_req)
        try:
            out.internal_state[STATE_KEY] = runtime.snapshot()
            out.internal_state[CONFIG_KEY] = runtime.config.as_dict()
        except Exception as exc:
            runtime.fail("internal_state", exc)
        return out

    return get_internal_state


def wrap_add_request_to_queue(
    original: Callable[..., Any],
    runtime: SemblendRuntime,
    substitute: Callable[[Any, Any], None],
) -> Any:
    """``_add_request_to_queue`` that, in substitute mode, calls ``substitute(scheduler, req)``
    for each arriving (not retracted) request before queueing it."""

    def _add_request_to_queue(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        retracted = kwargs.get("is_retracted", args[0] if args else False)
        if runtime.config.mode == "substitute" and not retracted and runtime.active:
            rid = getattr(req, "rid", None)
            runtime.guarded("substitute", rid, None, substitute, self, req)
        return original(self, req, *args, **kwargs)

    return _add_request_to_queue


def wrap_scheduler_init(original: Callable[..., Any], runtime: SemblendRuntime) -> Any:
    """``Scheduler.__init__`` that, once the scheduler is built, names every server option
    semantic reuse does not support (:func:`.server_options.unsupported_options`) and turns
    the runtime off for this scheduler (:meth:`SemblendRuntime.refuse`); otherwise the runtime
    takes the model's RoPE from the engine's resolved config
    (:meth:`SemblendRuntime.use_model_config`) and wraps the model's layers for a check-layer
    recompute strategy (:func:`.layer_hook.install`). The scheduler's forward stream is handed
    to the runtime in both cases (the copy waits for it)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        runtime.forward_stream = getattr(self, "forward_stream", None)
        server_args = getattr(self, "server_args", None)
        model_config = getattr(self, "model_config", None)
        refused = runtime.guarded(
            "startup", None, [], unsupported_options, server_args, model_config
        )
        if refused:
            runtime.refuse(refused)
            return
        hf_config = engine_hf_config(model_config)
        if hf_config is not None:
            runtime.guarded("startup", None, None, runtime.use_model_config, hf_config)
        runner = layer_hook.model_runner_of(self)
        if runner is not None:
            runtime.guarded("startup", None, None, layer_hook.install, runtime, runner)

    return __init__
