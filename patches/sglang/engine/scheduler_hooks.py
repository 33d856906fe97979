"""Wrappers for scheduler-side methods that every adapter installs the same way.

:func:`scheduler_wrappers` gives the adapter's hook table its scheduler part. The wrappers run
the original unchanged and never let an exception of semblend's reach the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..attention.backends import served_attention_refusal, set_sparse_path
from ..flow.engine_facts import EngineFacts
from ..flow.request_flow import RequestFlow
from ..wrapping import Wrappers
from . import check_install, kv_canary_record
from .http_routes import CONFIG_KEY, STATE_KEY
from .server_options import engine_hf_config, unsupported_options

ArrivalHook = Callable[[Any, Any], None]
"""``hook(scheduler, req)``, run on an arriving request before it is queued."""


def scheduler_wrappers(
    flow: RequestFlow,
    scheduler: type,
    internal_state_owner: type,
    substitute: ArrivalHook,
    reorder: ArrivalHook | None = None,
) -> Wrappers:
    """The wrappers of ``scheduler``'s ``__init__`` and ``_add_request_to_queue`` and of
    ``internal_state_owner.get_internal_state`` (the scheduler itself in older versions);
    ``reorder``: the adapter's passage-order hook (None: the version does not reorder)."""
    return {
        (internal_state_owner, "get_internal_state"): wrap_get_internal_state(
            internal_state_owner.get_internal_state, flow
        ),
        (scheduler, "_add_request_to_queue"): wrap_add_request_to_queue(
            scheduler._add_request_to_queue, flow, substitute, reorder
        ),
        (scheduler, "__init__"): wrap_scheduler_init(scheduler.__init__, flow),
    }


def wrap_get_internal_state(original: Callable[..., Any], flow: RequestFlow) -> Any:
    """``get_internal_state`` that adds semblend's counters and resolved config to the state
    SGLang's ``/server_info`` returns (read by ``GET /semblend/snapshot``)."""
    runtime = flow.runtime

    def get_internal_state(self: Any, recv_req: Any) -> Any:
        out = original(self, recv_req)
        try:
            out.internal_state[STATE_KEY] = runtime.snapshot()
            out.internal_state[CONFIG_KEY] = runtime.config.as_dict()
        except Exception as exc:
            flow.fail("internal_state", exc)
        return out

    return get_internal_state


def wrap_add_request_to_queue(
    original: Callable[..., Any],
    flow: RequestFlow,
    substitute: ArrivalHook,
    reorder: ArrivalHook | None = None,
) -> Any:
    """``_add_request_to_queue`` that, for each arriving (not retracted) request and before
    queueing it, calls ``reorder(scheduler, req)`` (a request that declared passages:
    :mod:`.passage_order`), then, in substitute mode, ``substitute(scheduler, req)``."""
    runtime = flow.runtime

    def _add_request_to_queue(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        retracted = kwargs.get("is_retracted", args[0] if args else False)
        if not retracted and runtime.active:
            rid = getattr(req, "rid", None)
            if reorder is not None:
                flow.guarded("passages", rid, None, reorder, self, req)
            if runtime.config.mode == "substitute":
                flow.guarded("substitute", rid, None, substitute, self, req)
        return original(self, req, *args, **kwargs)

    return _add_request_to_queue


def wrap_scheduler_init(original: Callable[..., Any], flow: RequestFlow) -> Any:
    """``Scheduler.__init__`` that, once the scheduler is built, names every server option
    semantic reuse does not support (:func:`.server_options.unsupported_options`) and turns
    the runtime off for this scheduler (:meth:`SemblendRuntime.refuse`). Otherwise it names an
    attention backend that will decline every plan (:meth:`SemblendRuntime.note_reuse_off`:
    the snapshot's ``reuse_off``), the runtime takes the model's RoPE from the engine's resolved
    config (:meth:`SemblendRuntime.use_model_config`) and the model's layers are wrapped for a
    check-layer recompute, whatever the server's strategy (:func:`.check_install.install`),
    and, where sglang installed its KV canary, the canary records copied slots
    (:func:`.kv_canary_record.install`). What it learned goes to the flow once
    (:meth:`.request_flow.RequestFlow.engine_started`); the scheduler's forward stream in both
    cases (the copy waits for it). A hook that fails to install is counted and logged once:
    the model is then taken as refusing the check layer."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        flow.engine_started(_start_up(self, flow))

    return __init__


def _start_up(scheduler: Any, flow: RequestFlow) -> EngineFacts:
    """:func:`wrap_scheduler_init`'s work on a built ``scheduler``; every step guarded."""
    runtime = flow.runtime
    stream = getattr(scheduler, "forward_stream", None)
    server_args = getattr(scheduler, "server_args", None)
    model_config = getattr(scheduler, "model_config", None)
    refused = flow.guarded(
        "startup",
        None,
        [],
        lambda: unsupported_options(server_args, model_config, paged=flow.view.paged),
    )
    if refused:
        runtime.refuse(refused)
        return EngineFacts(forward_stream=stream)
    backend_refusal = flow.guarded("startup", None, None, served_attention_refusal)
    if backend_refusal is not None:
        runtime.note_reuse_off(backend_refusal)
    flow.guarded("startup", None, None, set_sparse_path, runtime.config.sparse_path)
    hf_config = engine_hf_config(model_config)
    if hf_config is not None:
        flow.guarded("startup", None, None, runtime.use_model_config, hf_config)
    runner = check_install.model_runner_of(scheduler)
    if runner is None:
        return EngineFacts(forward_stream=stream)
    hook = flow.guarded("startup", None, None, check_install.install, flow, runner)
    canary = flow.guarded("startup", None, None, kv_canary_record.install, flow, runner)
    return EngineFacts(stream, hook is not None, hook, canary)
