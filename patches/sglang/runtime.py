"""Per-process semblend state shared by the SGLang hooks: the provider, donors, request plans.

One :class:`SemblendRuntime` per scheduler process (TP ranks each have their own and, fed the same
calls, decide the same). It imports no sglang module; the adapter passes sglang objects in.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from semblend_sglang.config import Config
from semblend_sglang.kernels import RopeSpec
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason, ReusePlan
from semblend_sglang.provider import SemanticProvider
from semblend_sglang.recompute import RecomputeStrategy, head_lengths

from .request_reuse import RequestReuse, ReuseState

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class HeldDonorCounts:
    """Counters of the held-donor store (process lifetime; ``tokens`` is the current size).

    ``kept``: finished requests whose unpublished prompt KV was kept; ``matched``: donor matches
    that used held slots; ``evicted``: entries freed for memory; ``dropped``: entries freed
    because their donor was dropped or the cache was reset."""

    kept: int = 0
    matched: int = 0
    evicted: int = 0
    dropped: int = 0
    tokens: int = 0


@dataclass
class RecomputeCounts:
    """Counters of the recompute budget (process lifetime).

    ``checks``: request chunks that reached a check layer; ``gated``: of those, refused by the
    quality gate; ``residual_deviation_sum``: the sum over checks of the mean relative K/V
    deviation left unrecomputed by the budget (divide by ``checks`` for the mean)."""

    checks: int = 0
    gated: int = 0
    residual_deviation_sum: float = 0.0


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
        self._donor_handles: dict[str, Hashable] = {}
        """Live requests registered as donors, with their donor handles."""
        self._handles = itertools.count()
        self._rope_spec: RopeSpec | None = None
        self._rope_error: str | None = None
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self.held = HeldDonorCounts()
        """What the adapter's held-donor store did (``held_donors`` in :meth:`snapshot`)."""
        self.recompute = RecomputeCounts()
        self.layer_check: bool | None = None
        """Whether the served model's layers take the check-layer recompute (set at scheduler
        start by :mod:`.layer_hook`); None while no model is known (an engine-less cache)."""
        self.check_hook: Any = None
        """The :class:`.layer_hook.LayerHook` of the served model, when installed."""
        self.refused: tuple[str, ...] = ()
        """Server options that rule reuse out (:meth:`refuse`); empty while reuse may run."""
        self.evicted_donors = 0
        """Donors forgotten when SGLang's eviction freed their KV (``evicted_donors`` in
        :meth:`snapshot`)."""
        self.forward_stream: Any = None
        """The device stream the engine's forward runs on (the scheduler's, set at its start;
        None on CPU or before): the K/V copy is ordered after it (:mod:`.one_pass`)."""

    # ----------------------------------------------------------------- start-up
    def refuse(self, options: list[str]) -> None:
        """The server runs with ``options`` that semantic reuse does not support: log them once
        (one line) and stay out of every request from now on (no lookup, no donor)."""
        self.refused = tuple(options)
        logger.warning(
            "semblend: semantic reuse is off in this scheduler; unsupported server options: %s",
            "; ".join(options),
        )

    @property
    def active(self) -> bool:
        """True unless :meth:`refuse` turned reuse off."""
        return not self.refused

    def snapshot(self) -> dict[str, Any]:
        """The provider's snapshot plus ``unsupported_options`` (what :meth:`refuse` named)."""
        snap = self.provider.snapshot()
        snap["unsupported_options"] = list(self.refused)
        snap["held_donors"] = dataclasses.asdict(self.held)
        snap["evicted_donors"] = self.evicted_donors
        snap["recompute_checks"] = self.recompute.checks
        snap["recompute_gated"] = self.recompute.gated
        snap["recompute_residual_deviation_sum"] = self.recompute.residual_deviation_sum
        return snap

    # ----------------------------------------------------------------- donors
    def register_donor(
        self, namespace: Namespace, rid: str, tokens: Any, *, extend: bool = False
    ) -> list[Hashable]:
        """Index a request's prompt tokens whose KV the engine holds as a donor: once per request,
        or, with ``extend``, replacing the tokens an earlier call registered for ``rid`` (its
        handle is kept). Returns the donors the index dropped to stay within its bound (the
        caller frees what it keeps for them)."""
        handle = self._donor_handles.get(rid)
        if handle is not None and not extend:
            return []
        if handle is None:
            handle = next(self._handles)
            self._donor_handles[rid] = handle
        return self.provider.register(namespace, handle, tokens)

    def donor_handle(self, rid: str) -> Hashable | None:
        """The donor handle of live request ``rid``, or None when it is not a donor."""
        return self._donor_handles.get(rid)

    def is_donor(self, handle: Hashable) -> bool:
        """True while ``handle`` is a registered donor."""
        return self.provider.has_donor(handle)

    def forget_donor(self, handle: Hashable) -> None:
        """Drop donor ``handle``: its KV is gone."""
        self.provider.forget(handle)

    def forget_all_donors(self) -> None:
        """Drop every donor (the engine's cache was reset, so none of their KV exists)."""
        for handle in self.provider.index.handles():
            self.provider.forget(handle)

    def is_tracked(self, rid: str) -> bool:
        """True while ``rid`` has a plan in this runtime or its plan was settled (declined,
        failed or decided at arrival): it is not looked up again until released."""
        return rid in self.requests or rid in self.settled

    def state_of(self, rid: str | None) -> RequestReuse | None:
        """The reuse state of ``rid``, or None when it has no plan."""
        return None if rid is None else self.requests.get(rid)

    @property
    def has_plans(self) -> bool:
        """True while any request has a plan in this runtime."""
        return bool(self.requests)

    def lookup(
        self,
        namespace: Namespace,
        tokens: Any,
        exact_len: int,
        rid: str,
        page_size: int,
        alive: Any = None,
    ) -> Any:
        """The provider's decision for request ``rid`` (:meth:`SemanticProvider.lookup`;
        ``alive``: the engine's count of a candidate donor's tokens whose KV is left)."""
        return self.provider.lookup(
            namespace, tokens, exact_len, rid, page_size=page_size, alive=alive
        )

    def opt_out(self, rid: str) -> None:
        """Request ``rid`` asked for no semantic reuse: decided as ``declined:opted_out`` once
        (its outcome counted), never planned; it still donates."""
        self.provider.decline_request(rid, Reason.OPTED_OUT)

    def settle(self, rid: str) -> None:
        """``rid`` was decided outside the match hooks (substitute mode at arrival): they leave it
        alone until it is released."""
        self.settled.add(rid)

    def settle_declined(self, rid: str, reason: str) -> None:
        """A request decided at arrival (:meth:`settle`) does not use its plan: ``reason``."""
        self.provider.record_declined(rid, reason)

    def settle_materialized(self, rid: str, tokens: int) -> None:
        """A request decided at arrival (:meth:`settle`) is served ``tokens`` reused tokens."""
        self.provider.record_materialized(rid, tokens)

    def donor_tokens(self, handle: Hashable) -> Any:
        """The donor's tokens as the index keeps them, or None when it was dropped."""
        return self.provider.donor_tokens(handle)

    # ----------------------------------------------------------------- requests
    def start(self, rid: str, namespace: Namespace, plan: ReusePlan) -> RequestReuse:
        """Track ``plan`` for request ``rid``; its spans are materialized in target order."""
        order = sorted(range(len(plan.spans)), key=lambda i: plan.spans[i].target_start)
        spans = tuple(plan.spans[i] for i in order)
        heads: tuple[int, ...] = ()
        if self.config.recompute_strategy == RecomputeStrategy.HEADS:
            heads = tuple(head_lengths([s.length for s in spans], self.config.recompute_ratio))
        state = RequestReuse(
            rid=rid,
            namespace=namespace,
            plan=plan,
            spans=spans,
            donors=tuple(plan.donor_of(i) for i in order),
            heads=heads if any(heads) else (),
        )
        self.requests[rid] = state
        return state

    @property
    def check_layer_active(self) -> bool:
        """True when the configured strategy selects at a check layer and the served model's
        layers take the hook (:attr:`layer_check`). While no model is known (the cache without
        an engine) such a strategy recomputes nothing; where the model refused the hook,
        plans are declined (``unsupported_model``, by the adapter)."""
        strategy = self.config.recompute_strategy
        return strategy.uses_check_layer and self.layer_check is True

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
        """No further span of ``rid`` is materialized; record its outcome: materialized, or
        ``declined:quality_gate`` when the gate had every copied position recomputed."""
        self._stop_after_reuse(rid)

    def observe_copy(self, seconds: float) -> None:
        """One prefill batch's donor K/V copy took ``seconds`` (device work included)."""
        self.provider.telemetry.observe_copy(seconds)

    def count_recomputed(self, tokens: int) -> None:
        """``tokens`` reused positions were recomputed by the scheduler (span heads)."""
        self.provider.telemetry.observe_recomputed(tokens)

    def checked(self, rid: str, recomputed: int, gated: bool, residual: float, final: bool) -> None:
        """A check layer recomputed ``recomputed`` of the positions ``rid`` copied in this chunk
        (``gated``: all, by the quality gate; ``residual``: the mean deviation the budget left).
        ``final``: the chunk ends the prompt, so the outcome is recorded now."""
        self.provider.telemetry.observe_recomputed(recomputed)
        self.recompute.checks += 1
        self.recompute.gated += int(gated)
        self.recompute.residual_deviation_sum += residual
        state = self.requests.get(rid)
        if state is None:
            return
        state.checked(recomputed, gated)
        if final:
            self.finish_reuse(rid)

    def _stop_after_reuse(self, rid: str) -> bool:
        state = self.requests.get(rid)
        if state is None or not state.reused_any:
            return False
        if state.state is not ReuseState.MATERIALIZED:
            state.complete()
            if state.gated and state.reused_total <= 0:
                self.provider.record_declined(rid, Reason.QUALITY_GATE)
            else:
                self.provider.record_materialized(
                    rid,
                    state.reused_total,
                    spans=state.spans_loaded,
                    donors=len(state.donors_loaded),
                )
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
        """The request ended (finished, aborted or retracted): drop its state. A request that
        reused KV and had not yet recorded its outcome (aborted or retracted mid-prefill) is
        recorded as materialized with the tokens it reused."""
        self._stop_after_reuse(rid)
        self.requests.pop(rid, None)
        self.settled.discard(rid)
        self._donor_handles.pop(rid, None)
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

    def use_model_config(self, hf_config: Any) -> None:
        """Take the served model's RoPE from ``hf_config``, the HF config the engine resolved
        (``--json-model-override-args`` and ``--revision`` applied), instead of reading
        config.json later. An unsupported RoPE is logged once and every plan is declined."""
        try:
            self._rope_spec = RopeSpec.from_hf_config(hf_config)
            self._rope_error = None
        except Exception as exc:
            self._rope_spec = None
            self._rope_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "semblend: cannot reuse KV for this model (%s); every plan is declined as %s",
                self._rope_error,
                Reason.UNSUPPORTED_CACHE,
            )

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
