"""Per-process semblend state shared by the SGLang hooks: the provider, donors, request plans.

One :class:`SemblendRuntime` per scheduler process (TP ranks each have their own and, fed the same
calls, decide the same). It imports no sglang module; the adapter passes sglang objects in.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from semblend_sglang.align import Span
from semblend_sglang.config import Config
from semblend_sglang.kernels import RopeSpec
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason, ReusePlan
from semblend_sglang.provider import SemanticProvider

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class RequestReuse:
    """The reuse plan of one request and how far it got.

    Spans are materialized in target order. For the current span ``index``: ``boundary`` (a')
    is where the request's own computation stops and reused KV starts, ``end`` (b') where reuse
    ends. ``phase``: ``planned`` (looked up), ``head`` (the scheduler will end a prefill chunk
    at ``boundary``), ``materialized`` (no further span will be materialized). Once any span
    is materialized nothing from ``publish_cap`` (the first span's a') on may be published.
    """

    rid: str
    namespace: Namespace
    plan: ReusePlan
    spans: tuple[Span, ...]
    index: int = 0
    phase: str = "planned"
    reused_total: int = 0
    """Tokens materialized so far, over all spans."""

    @property
    def span(self) -> Span:
        """The span being (or last) materialized."""
        return self.spans[self.index]

    @property
    def boundary(self) -> int:
        """a' of the current span."""
        return self.span.target_start

    @property
    def end(self) -> int:
        """b' of the current span."""
        return self.span.target_end

    @property
    def donor_start(self) -> int:
        """Where the current span starts in the donor."""
        return self.span.donor_start

    @property
    def reused_tokens(self) -> int:
        """Tokens of the current span whose KV comes from the donor."""
        return self.span.length

    @property
    def delta(self) -> int:
        """Position shift applied to the donor's keys for the current span."""
        return self.span.delta

    @property
    def publish_cap(self) -> int:
        """The first span's a': the request publishes nothing from here on once it reused KV."""
        return self.spans[0].target_start

    @property
    def reused_any(self) -> bool:
        """True once at least one span's KV was copied into the request's slots."""
        return self.reused_total > 0


class SemblendRuntime:
    """Holds the provider and the per-request reuse state for one scheduler process.

    The hooks call it; it never raises to them: :meth:`fail` records an error as the request's
    cold fallback and logs once per place and exception type.
    """

    def __init__(self, config: Config, *, registry: Any = None) -> None:
        self.config = config
        self.provider = SemanticProvider(
            config, None, registry=registry, detokenize=self.detokenize
        )
        self.requests: dict[str, RequestReuse] = {}
        self.settled: set[str] = set()
        """Requests whose plan was declined or failed: not planned again until released."""
        self.registered: set[str] = set()
        self._handles = itertools.count()
        self._rope_spec: RopeSpec | None = None
        self._rope_error: str | None = None
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    # ----------------------------------------------------------------- donors
    def register_donor(self, namespace: Namespace, rid: str, tokens: Any) -> None:
        """Index a request's published prompt tokens as a donor (once per request)."""
        if rid in self.registered:
            return
        self.registered.add(rid)
        handle: Hashable = next(self._handles)
        self.provider.register(namespace, handle, tokens)

    def forget_all_donors(self) -> None:
        """Drop every donor (the engine's cache was reset, so none of their KV exists)."""
        for handle in self.provider.index.handles():
            self.provider.forget(handle)

    def donor_tokens(self, handle: Hashable) -> Any:
        """The donor's tokens as the index keeps them, or None when it was dropped."""
        return self.provider.donor_tokens(handle)

    # ----------------------------------------------------------------- requests
    def start(self, rid: str, namespace: Namespace, plan: ReusePlan) -> RequestReuse:
        """Track ``plan`` for request ``rid``; its spans are materialized in target order."""
        spans = tuple(sorted(plan.spans, key=lambda s: s.target_start))
        state = RequestReuse(rid=rid, namespace=namespace, plan=plan, spans=spans)
        self.requests[rid] = state
        return state

    def decline(self, rid: str, reason: str) -> None:
        """The engine will not use (the rest of) the plan of ``rid``; the request continues
        normally. A request that already reused a span keeps its state (its publish cap still
        applies) and ends as materialized with the tokens reused so far."""
        self.settled.add(rid)
        if self._stop_after_reuse(rid):
            return
        if self.requests.pop(rid, None) is not None:
            self.provider.record_declined(rid, reason)

    def finish_reuse(self, rid: str) -> None:
        """No further span of ``rid`` is materialized; record its outcome (materialized)."""
        self._stop_after_reuse(rid)

    def _stop_after_reuse(self, rid: str) -> bool:
        state = self.requests.get(rid)
        if state is None or not state.reused_any:
            return False
        state.phase = "materialized"
        self.provider.record_materialized(rid, state.reused_total)
        return True

    def guarded(
        self, where: str, rid: str | None, default: _T, fn: Callable[..., _T], *args: Any
    ) -> _T:
        """Run ``fn(*args)`` for an engine hook: its time is added to the hook-time counter, and
        an exception is turned into :meth:`fail` (``where``, ``rid``) and ``default``. Never
        raises (an exception not derived from ``Exception`` still propagates)."""
        started = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:
            self.fail(where, exc, rid)
            return default
        finally:
            self.provider.telemetry.observe_hook(time.perf_counter() - started)

    def fail(self, where: str, exc: BaseException, rid: str | None = None) -> None:
        """An error in a hook: count it, log once, and make the request a cold fallback."""
        key = (where, type(exc).__name__)
        with self._lock:
            first = key not in self._logged
            self._logged.add(key)
        if first:
            logger.warning(
                "semblend %s failed (%s: %s); the request falls back to a normal prefill",
                where,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        if rid is not None:
            self.settled.add(rid)
        if rid is not None and self._stop_after_reuse(rid):
            self.provider.telemetry.record_error(where)  # reused KV stays, capped
        elif rid is not None and self.requests.pop(rid, None) is not None:
            self.provider.record_cold_fallback(rid, where)
        else:
            self.provider.telemetry.record_error(where)

    def abort(self, rid: str) -> None:
        """The engine dropped ``rid`` without running it to its release (aborted while waiting):
        its plan is declined as ``aborted`` and its state dropped. A request that already reused
        KV keeps its state: it holds slots, so the engine's release (which applies the publish
        cap) is still to come."""
        state = self.requests.get(rid)
        if state is not None and state.reused_any:
            return
        if state is not None:
            self.decline(rid, Reason.ABORTED)
        self.release(rid)

    def release(self, rid: str) -> None:
        """The request ended (finished, aborted or retracted): drop its state."""
        self.requests.pop(rid, None)
        self.settled.discard(rid)
        self.registered.discard(rid)
        self.provider.release(rid)

    # ----------------------------------------------------------------- model
    def detokenize(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` with the served model's tokenizer (substitute-mode embedding
        gate only; loaded on first use from the server's tokenizer path, offline)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from .request_info import served_tokenizer_path

            path = served_tokenizer_path()
            if path is None:
                raise FileNotFoundError("no tokenizer path known to this process")
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    def set_rope_spec(self, spec: RopeSpec) -> None:
        """Use ``spec`` for K rotation (tests and in-process engines that know their model)."""
        self._rope_spec = spec

    def rope_spec(self, model_path: str | None) -> RopeSpec | None:
        """RoPE of the served model, read once from its config.json; None (logged once) when
        the model's rotary embedding is not supported or its config cannot be read."""
        if self._rope_spec is not None or self._rope_error is not None:
            return self._rope_spec
        try:
            if model_path is None:
                raise FileNotFoundError("no model path known to this process")
            config_file = Path(model_path) / "config.json"
            if config_file.is_file():
                hf_config: Any = json.loads(config_file.read_text())
            else:
                from transformers import AutoConfig

                hf_config = AutoConfig.from_pretrained(model_path)
            self._rope_spec = RopeSpec.from_hf_config(hf_config)
        except Exception as exc:
            self._rope_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "semblend: cannot reuse KV for this model (%s); every plan is declined as %s",
                self._rope_error,
                Reason.UNSUPPORTED_CACHE,
            )
        return self._rope_spec
