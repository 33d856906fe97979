"""Donor-aware dispatch inside SGLang's own ``DataParallelController`` (sglang 0.5.22+).

The plugin (:func:`semblend_sglang.patches.sglang.load_plugin`) runs in the controller process
before the controller is built; :func:`install_dp_dispatch` wraps
``DataParallelController.__init__`` so that each controller, once built, sends its requests
through :class:`DonorAwareDispatch` (it replaces the instance's ``dispatching``, the one method
every generate request goes through, single or batched; health checks do not).

Per request: a client-pinned request (``routed_dp_rank`` in the request body; sglang 0.5.23's
HTTP server reads no header for it) goes to SGLang's own method untouched. Otherwise
:class:`~semblend_sglang.dispatch.DonorRouter` proposes the rank holding the request's donor,
judged on the controller's load view (``DPBudget.total_tokens``: KV in use plus queued tokens per
rank, refreshed from the ranks' load snapshots, plus this hook's count of what it and the pins
sent since); with no proposal SGLang's configured method (round_robin, total_requests,
total_tokens) decides. The rank the request went to, whoever chose it, is recorded as the
request's donor rank. Fail open: any error in semblend's part is counted, logged once, and the
request goes to SGLang's own method. Nothing here runs in the schedulers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from semblend_sglang.config import Config
from semblend_sglang.dispatch import DonorRouter, Route
from semblend_sglang.namespace import Namespace
from semblend_sglang.once_log import OnceLog

from ..request_info import namespace_for

logger = logging.getLogger(__name__)

CONTROLLER_MODULE = "sglang.srt.managers.data_parallel_controller"
DISPATCH_ATTR = "_semblend_dispatch"
"""Attribute of a wrapped controller instance that holds its :class:`DonorAwareDispatch`."""

_lock = threading.Lock()
_originals: dict[str, Any] = {}


def request_namespace(req: Any) -> Namespace:
    """The provider's namespace of a tokenized request, as the scheduler will build it: its
    ``Req`` appends ``lora_id`` to ``extra_key`` and turns an empty ``cache_salt`` into None
    (schedule_batch.Req.__init__), and :func:`.request_info.namespace_for` reads that ``Req``."""
    lora_id = getattr(req, "lora_id", None)
    extra_key = getattr(req, "extra_key", None)
    if lora_id is not None:
        extra_key = (extra_key or "") + lora_id
    return namespace_for(
        SimpleNamespace(
            lora_id=lora_id,
            extra_key=extra_key,
            cache_salt=getattr(req, "cache_salt", None) or None,
        )
    )


def _routable(req: Any) -> bool:
    """Generate requests whose KV is a function of their token ids (see request_info.eligible)."""
    return (
        getattr(req, "input_ids", None) is not None
        and getattr(req, "input_embeds", None) is None
        and getattr(req, "mm_inputs", None) is None
        and getattr(req, "positional_embed_overrides", None) is None
        and getattr(req, "session_params", None) is None
        and getattr(req, "bootstrap_room", None) is None
    )


class DonorAwareDispatch:
    """Replaces one controller's ``dispatching``; keeps SGLang's as ``original``.

    Called only by the controller's event loop thread (``dispatching_with_trace``). May not
    override a pinned request, may not send to an inactive rank, may not raise for a reason of
    its own (SGLang's own errors, e.g. a pin to an inactive rank, propagate unchanged).
    """

    LOG_EVERY = 1024

    def __init__(
        self,
        controller: Any,
        original: Callable[[Any], None],
        config: Config,
        sock_send: Callable[[Any, Any], None],
    ) -> None:
        self.controller = controller
        self.original = original
        self.config = config
        self._sock_send = sock_send
        capacity = getattr(controller, "max_total_num_tokens", None)
        n_ranks = len(controller.workers)
        self.router = DonorRouter(config, n_ranks, capacity)
        self.errors = 0
        self.dispatched = 0
        self.flushes = 0
        self._failures = OnceLog(logger, "SGLang's own method decides")
        self._sent_to: Any = None
        method = getattr(controller, "load_balance_method", None)
        self._sglang_counts_budget = getattr(method, "name", "") in (
            "TOTAL_REQUESTS",
            "TOTAL_TOKENS",
        )

    # ------------------------------------------------------------------ entry
    def __call__(self, req: Any) -> None:
        route: Route | None = None
        namespace: Namespace | None = None
        pinned = getattr(req, "routed_dp_rank", None) is not None
        if not pinned and _routable(req):
            try:
                namespace = request_namespace(req)
                route = self._choose(namespace, req)
            except Exception as exc:
                self._fail("choose", exc)
                route = None
        if route is not None and route.rank is not None:
            rank = route.rank
            self._send(rank, req)
        else:
            rank = self._run_original(req)
        self.dispatched += 1
        if rank is None or not _routable(req):
            return
        try:
            if namespace is None:
                namespace = request_namespace(req)
            self.router.record(namespace, req.input_ids, rank, route)
        except Exception as exc:
            self._fail("record", exc)
        self._maybe_log(route)

    def control(self, fallback: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The controller's fallback for control messages (``send_control_message``, which
        broadcasts them to the ranks), wrapped: a ``FlushCacheReqInput`` first makes the router
        forget every rank's entries (their KV is about to go), then goes on unchanged."""

        def send_control_message(obj: Any) -> Any:
            if type(obj).__name__ == "FlushCacheReqInput":
                try:
                    for rank in range(self.router.n_ranks):
                        self.router.forget_rank(rank)
                    self.flushes += 1
                    logger.info("semblend dispatch: %s", self.stats())
                except Exception as exc:
                    self._fail("flush", exc)
            return fallback(obj)

        return send_control_message

    def _maybe_log(self, route: Route | None) -> None:
        """One INFO line of :meth:`stats` when the dispatch count, or the count of this
        request's reason, reaches a power of two, and every ``LOG_EVERY`` dispatches: a few
        lines per reason over a server's life, the first of each at once."""
        n = self.dispatched
        counts = self.router.counts
        k = counts.get(route.reason, 0) if route is not None else 0
        if n & (n - 1) == 0 or n % self.LOG_EVERY == 0 or (k and k & (k - 1) == 0):
            logger.info("semblend dispatch: %s", self.stats())

    def stats(self) -> dict[str, int]:
        """The router's counters plus dispatches and errors of this hook."""
        out = self.router.stats()
        out["dispatched"] = self.dispatched
        out["errors"] = self.errors
        out["flushes"] = self.flushes
        return out

    # ------------------------------------------------------------------ internals
    def _choose(self, namespace: Namespace, req: Any) -> Route:
        controller = self.controller
        try:
            controller.refresh_load_budget()  # throttled by SGLang (20 ms)
        except Exception as exc:
            self._fail("refresh_load_budget", exc)
        active = [r for r in controller._active_workers if controller.status[r]]
        loads = controller.dp_budget.total_tokens
        return self.router.choose(namespace, req.input_ids, loads, active)

    def _send(self, rank: int, req: Any) -> None:
        budget = self.controller.dp_budget
        budget.total_requests[rank] += 1  # DPBudget.dispatch's own speculative increments
        budget.total_tokens[rank] += len(req.input_ids)
        self._sock_send(self.controller.workers[rank], req)

    def _run_original(self, req: Any) -> int | None:
        """SGLang's method decides; returns the rank it sent to (None if it sent nothing)."""
        self._sent_to = None
        _capture.target = self
        try:
            self.original(req)
        finally:
            _capture.target = None
        socket = self._sent_to
        if socket is None:
            return None
        pinned = getattr(req, "routed_dp_rank", None) is not None
        for rank, worker in enumerate(self.controller.workers):
            if worker is socket:
                # SGLang counts only what DPBudget.dispatch placed; count pins and
                # round-robin too, or a burst pinned to one rank stays invisible until that
                # rank publishes its next load snapshot (between its batches).
                if pinned or not self._sglang_counts_budget:
                    budget = self.controller.dp_budget
                    budget.total_requests[rank] += 1
                    budget.total_tokens[rank] += len(getattr(req, "input_ids", ()) or ())
                return rank
        return None

    def _fail(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._failures.log(f"dispatch {where}", exc)


class _Capture(threading.local):
    target: DonorAwareDispatch | None = None


_capture = _Capture()


def _make_sock_send(original: Callable[..., Any]) -> Callable[..., Any]:
    def sock_send(socket: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        target = _capture.target
        if target is not None:
            target._sent_to = socket
        return original(socket, obj, *args, **kwargs)

    sock_send.__wrapped__ = original  # type: ignore[attr-defined]
    return sock_send


def install_dp_dispatch(config: Config | None = None) -> bool:
    """Wrap ``DataParallelController.__init__`` (and the module's ``sock_send``, to learn which
    rank SGLang's own method picked) so every controller built afterwards dispatches through
    :class:`DonorAwareDispatch`. Idempotent. Returns False (changing nothing) when the
    controller has no ``dispatching`` / ``dp_budget`` / ``workers`` of the expected shape, or
    when ``dispatch_enabled`` is off. Called by the plugin in the controller's process."""
    config = config or Config.from_env()
    if not (config.enabled and config.dispatch_enabled):
        return False
    import importlib

    module = importlib.import_module(CONTROLLER_MODULE)
    cls = getattr(module, "DataParallelController", None)
    budget_cls = getattr(module, "DPBudget", None)
    if cls is None or budget_cls is None or not hasattr(module, "sock_send"):
        logger.warning("semblend: this sglang's DataParallelController is not supported")
        return False
    with _lock:
        if _originals:
            return True
        init = cls.__init__
        sock_send = module.sock_send
        wrapped_send = _make_sock_send(sock_send)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            try:
                hook = DonorAwareDispatch(self, self.dispatching, config, sock_send)
                self.dispatching = hook
                setattr(self, DISPATCH_ATTR, hook)
                dispatcher = getattr(self, "_request_dispatcher", None)
                fallback = getattr(dispatcher, "_fallback_fn", None)
                if fallback is not None:  # /flush_cache reaches the ranks through it
                    dispatcher.add_fallback_fn(hook.control(fallback))
                logger.info(
                    "semblend: donor-aware dispatch over %d ranks (fallback: %s)",
                    len(self.workers),
                    getattr(self.load_balance_method, "name", "?"),
                )
            except Exception as exc:
                logger.error(
                    "semblend: donor-aware dispatch not installed (%s: %s)",
                    type(exc).__name__,
                    exc,
                )

        _originals["init"] = init
        _originals["sock_send"] = sock_send
        cls.__init__ = __init__
        module.sock_send = wrapped_send
    return True


def uninstall_dp_dispatch() -> None:
    """Restore ``DataParallelController.__init__`` and ``sock_send``; idempotent. Controllers
    built while installed keep their hook."""
    import importlib

    with _lock:
        if not _originals:
            return
        module = importlib.import_module(CONTROLLER_MODULE)
        module.DataParallelController.__init__ = _originals.pop("init")
        module.sock_send = _originals.pop("sock_send")
