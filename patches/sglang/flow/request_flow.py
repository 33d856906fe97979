"""One request's semantic path through SGLang, in the order it runs.

The steps (plan, pin donors and copy, check layer, forward, publish cap, end) are told once,
in docs/architecture.md ("One request through SGLang 0.5.22+").

:class:`RequestFlow` owns every request's state (one object per request, in
:attr:`RequestFlow.requests`); the version adapters only wrap sglang's methods and call it,
with their :class:`~.version_view.VersionView` for what is named differently per version.
Nothing here imports sglang. An error becomes a counted, once-logged fallback
(:meth:`RequestFlow.guarded`); the one exception here is :meth:`RequestFlow.forward_batch`'s
(the raise rule of :mod:`.adapter`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from semblend_sglang.config import Config
from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason, ReusePlan
from semblend_sglang.recompute import RecomputeStrategy, head_lengths
from semblend_sglang.request_settings import RequestSettings

from ..request_info import (
    eligible,
    namespace_for,
    reuse_settings,
)
from ..runtime import SemblendRuntime
from ..version_view import VersionView
from . import batch_state, span_copy
from .donor_kv import DonorKV
from .engine_facts import EngineFacts
from .engine_support import EngineSupport
from .request_reuse import CheckOutcome, RequestReuse

_T = TypeVar("_T")


class RequestFlow:
    """The semantic path of every request in one scheduler process (TP ranks each have their
    own and, fed the same calls, decide the same).

    Called by the adapter's wrappers of sglang methods, in the order of the module docstring.
    Owns the per-request states (:attr:`requests`) and the donors (:attr:`donors`); per-process
    state is the :attr:`runtime`'s. SGLang calls every hooked method on the scheduler's thread,
    so this state, and all it owns, is read and changed on that thread only: nothing here or
    below it takes a lock. Never raises to the engine from :meth:`guarded`."""

    def __init__(self, config: Config, runtime: SemblendRuntime, view: VersionView) -> None:
        self.config = config
        self.runtime = runtime
        self.view = view
        self.requests: dict[str, RequestReuse] = {}
        """Requests with a plan, until their release (or until the plan ends with nothing
        copied)."""
        self.decided: set[str] = set()
        """Requests decided already (declined, failed, decided at arrival): not planned again
        until released."""
        self.donors = DonorKV(runtime.provider, config, view)
        self._engine = EngineFacts()
        runtime.report_flow(self._snapshot_part)
        self.support = EngineSupport(runtime, view)
        """Whether this server's cache, pool, RoPE and attention backend take reused KV."""

    # ----------------------------------------------------------------- start-up
    def engine_started(self, facts: EngineFacts) -> None:
        """What the scheduler's start-up learned (:func:`.scheduler_hooks.wrap_scheduler_init`,
        once per scheduler; again only where a test or an unpatch takes the canary away)."""
        self._engine = facts

    @property
    def engine(self) -> EngineFacts:
        """The facts of the last :meth:`engine_started` (the defaults before it)."""
        return self._engine

    def _snapshot_part(self) -> dict[str, Any]:
        """The donors' counters and ``kv_canary_recorded`` (forward batches and slots written
        to SGLang's KV canary: :mod:`.kv_canary_record`), for the runtime's snapshot."""
        canary = self._engine.canary
        part = self.donors.snapshot()
        part["kv_canary_recorded"] = {
            "batches": 0 if canary is None else canary.batches,
            "slots": 0 if canary is None else canary.slots,
        }
        return part

    # ----------------------------------------------------------------- 0. the guard
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
            self.runtime.observe_hook(time.perf_counter() - started)

    def fail(self, where: str, exc: BaseException, rid: str | None = None) -> None:
        """An error in the semantic path: logged once, counted, and request ``rid`` (if any)
        continues on the normal path (a cold fallback, or, having reused KV, with what it
        kept and its publish cap)."""
        self.runtime.log_failure(where, exc)
        state = None if rid is None else self.requests.get(rid)
        if rid is not None:
            self.decided.add(rid)
        if state is not None and state.fail(where):
            del self.requests[state.rid]
        else:
            self.runtime.record_error(where)

    def is_tracked(self, rid: str) -> bool:
        """True while ``rid`` has a plan or was decided already: it is not looked up again
        until released."""
        return rid in self.requests or rid in self.decided

    def state_of(self, rid: str | None) -> RequestReuse | None:
        """The plan of ``rid``, or None when it has none."""
        return None if rid is None else self.requests.get(rid)

    # ----------------------------------------------------------------- 1. plan
    def plan(
        self, cache: Any, req: Any, tokens: Any, limit: int | None, exact_len: int
    ) -> RequestReuse | None:
        """The first lookup of ``req`` (match key ``tokens`` limited to ``limit`` + 1, exact hit
        ``exact_len``): its state when a plan stands, else None (no plan, or declined as
        ``unsupported_cache`` / ``spans_trimmed_away``). Later matches of the same request, and
        substitute mode, return None without a lookup."""
        runtime = self.runtime
        rid = req.rid
        if self.is_tracked(rid) or not runtime.active:
            return None
        if not self.config.enabled or self.config.mode == "substitute" or not eligible(req):
            return None  # substitute mode decides at arrival
        settings = reuse_settings(req, self.config)
        if settings is None:
            self.opt_out(rid)
            return None
        usable = len(tokens) if limit is None else min(len(tokens), int(limit) + 1)
        namespace = namespace_for(req)
        decision = runtime.lookup(
            LookupParams(
                namespace,
                tokens[:usable],
                exact_len,
                rid,
                int(cache.page_size),
                self.donors.liveness(cache, namespace),
                lambda handle: self.donors.forget(handle, cache),
            )
        )
        if decision.kind != "plan" or decision.plan is None:
            return None
        state = self.start(rid, namespace, decision.plan, settings)
        if not self.support.cache_supported(cache):
            self.decline(rid, Reason.UNSUPPORTED_CACHE)
            return None
        if state.spans[-1].target_end <= exact_len:
            self.decline(rid, Reason.SPANS_TRIMMED_AWAY)
            return None
        return state

    def start(
        self,
        rid: str,
        namespace: Namespace,
        plan: ReusePlan,
        settings: RequestSettings | None = None,
    ) -> RequestReuse:
        """Track ``plan`` for request ``rid`` served with ``settings`` (None: the server's);
        its spans are materialized in target order."""
        settings = RequestSettings(self.config) if settings is None else settings
        config = settings.config
        order = sorted(range(len(plan.spans)), key=lambda i: plan.spans[i].target_start)
        spans = tuple(plan.spans[i] for i in order)
        heads: tuple[int, ...] = ()
        if config.recompute_strategy is RecomputeStrategy.HEADS:
            heads = tuple(head_lengths([s.length for s in spans], config.recompute_ratio))
        self.runtime.count_settings(settings.label, "planned")
        state = RequestReuse(
            rid=rid,
            outcomes=self.runtime.provider,
            namespace=namespace,
            plan=plan,
            spans=spans,
            donors=tuple(plan.donor_of(i) for i in order),
            heads=heads if any(heads) else (),
            settings=settings,
        )
        self.requests[rid] = state
        return state

    def selects_at_check_layer(self, state: RequestReuse) -> bool:
        """True when ``state``'s strategy selects at a check layer and the served model's
        layers take the hook. While no model is known (the cache without an engine) such a
        strategy recomputes nothing; where the model refused the hook its plans are declined
        (``unsupported_model``, :meth:`prepare_extend`)."""
        return state.checks_at_layer and self._engine.layer_check is True

    def opt_out(self, rid: str) -> None:
        """Request ``rid`` asked for no semantic reuse: decided as ``declined:opted_out`` once
        (its outcome counted), never planned; it still donates."""
        self.runtime.provider.decline_request(rid, Reason.OPTED_OUT)

    # ----------------------------------------------------------------- 2. pin donors and copy
    def prepare_extend(self, batch: Any) -> None:
        """After ``prepare_for_extend``: copy the batch's reused spans (:mod:`.span_copy`). An
        error leaves the batch as sglang built it and makes its planned requests cold
        fallbacks. Where other ranks run the batch too, this takes part in their agreement on
        every prefill batch, planned here or not (:mod:`.rank_agreement`)."""
        runtime = self.runtime
        cache = batch.tree_cache
        if cache is None:
            return
        peers = self.view.peers(cache)
        states = {r.rid: s for r in batch.reqs if (s := self.requests.get(r.rid)) is not None}
        if not peers and not states:
            return
        spec = self.support.rope_spec()
        for state in states.values():
            refused = None if spec is not None else Reason.UNSUPPORTED_CACHE
            if self._engine.layer_check is False and state.checks_at_layer:
                refused = Reason.UNSUPPORTED_MODEL
            if refused is not None and state.open and not state.reused_any:
                self.decline(state.rid, refused)
        if spec is None and not peers:
            return
        before = {rid: s.reused_total for rid, s in states.items()}
        params = span_copy.LoadParams(
            cache,
            batch,
            {rid: s for rid, s in states.items() if rid in self.requests},
            self.view,
            self.donors,
            spec,
            peers,
            self._engine.layer_check is True,
            self._engine.forward_stream,
        )
        try:
            result = span_copy.load_batch_spans(params)
        except Exception as exc:  # the batch is unchanged: its requests compute every position
            for rid in states:
                if rid in self.requests:
                    self.fail("load", exc, rid)
            return
        if result.copy_seconds is not None:
            runtime.observe_copy(result.copy_seconds)
        runtime.count_recomputed(result.recomputed)
        self._drop_ended(result.touched)
        if self.config.report_reuse_to_client:
            self._report_reused(batch, before)

    def _report_reused(self, batch: Any, before: dict[str, int]) -> None:
        """``report_reuse_to_client``: add the tokens this chunk copied to each request's
        ``cached_tokens`` (sglang counted the chunk's exact prefix already)."""
        for req in batch.reqs:
            state = self.requests.get(req.rid)
            copied = 0 if state is None else state.reused_total - before.get(req.rid, 0)
            if copied > 0:
                req.cached_tokens += copied
                if hasattr(req, "cached_tokens_device"):
                    req.cached_tokens_device += copied

    # ----------------------------------------------------------------- 3. check layer
    def checked(self, outcome: CheckOutcome) -> None:
        """A check layer chose ``outcome`` (:class:`.request_reuse.CheckOutcome`); a final
        chunk's plan completes now."""
        self.runtime.count_check(outcome)
        state = self.requests.get(outcome.rid)
        if state is None:
            return
        state.checked(outcome.recomputed, outcome.gated)
        if outcome.final:
            state.complete()

    # ----------------------------------------------------------------- 4. forward
    def forward_batch(self, batch: Any, model_runner: Any, forward_batch: Any) -> None:
        """After ``ForwardBatch.init_new`` built ``forward_batch`` for ``batch``: the first
        forward learns the attention backend; SGLang's KV canary, where it runs, notes the
        batch; a check layer is armed; a batch with sparse requests gets their true positions (a
        decode forward forgets them). Raises the ``ValueError`` of
        :func:`.batch_state.forward_positions` when that batch's lengths and positions disagree:
        its KV is copied, no normal path is left (:mod:`.adapter`)."""
        if self.support.backend_ok is None:
            self.guarded("backend", None, None, self.support.learn_backend, model_runner)
        canary = self._engine.canary  # sglang's KV canary (kv_canary_record.py)
        if canary is not None:
            self.guarded("kv_canary", None, None, canary.note, batch, forward_batch)
        hook = self._engine.check_hook
        reuse = batch_state.batch_reuse(batch)
        if reuse is None:
            return
        if hook is not None and reuse.candidates:
            self.guarded("arm", None, None, hook.arm, batch, forward_batch)
        if reuse.sparse and forward_batch.positions is not None:
            if forward_batch.forward_mode.is_decode_or_idle():
                batch_state.clear(batch)
            else:
                forward_batch.positions = batch_state.forward_positions(
                    batch, forward_batch.positions
                )

    # ----------------------------------------------------------------- 5. publish cap
    def publish_limit(self, rid: str | None, up_to: int) -> int:
        """How far request ``rid`` may publish into the exact cache when sglang would publish
        ``up_to``: never past its first copied position once it reused KV."""
        cap = self.publish_cap(rid)
        return up_to if cap is None else min(up_to, cap)

    def publish_cap(self, rid: str | None) -> int | None:
        """The publish cap of ``rid`` once it reused KV, else None."""
        state = self.state_of(rid)
        return state.publish_cap if state is not None and state.reused_any else None

    def published(self, req: Any, published_len: int, page_size: int = 1) -> None:
        """The tree was asked to hold ``req``'s sequence up to ``published_len`` (whole
        ``page_size`` pages of it): it donates its prompt (:meth:`register_donor`); a finished
        request that reused KV is marked to keep the rest of its prompt as a held donor when its
        row is released (:meth:`.DonorKV.mark_finished`)."""
        cap = self.publish_cap(req.rid)
        self.register_donor(req, published_len, cap, page_size)
        state = self.requests.get(req.rid)
        if cap is not None and state is not None and req.finished():
            self.donors.mark_finished(req, state.namespace)

    def register_donor(
        self, req: Any, published_len: int, cap: int | None = None, page_size: int = 1
    ) -> None:
        """``req``'s prompt is published up to ``published_len``: index it as a donor once the
        tree holds all of it that it ever will (:meth:`.DonorKV.register_published`; ``cap``:
        the publish cap of a request that reused KV)."""
        if self.runtime.active:
            self.donors.register_published(req, published_len, cap, page_size)

    # ----------------------------------------------------------------- 6. end
    def decline(self, rid: str, reason: str) -> None:
        """The engine will not use (the rest of) the plan of ``rid``; the request continues
        normally. A request that already reused KV keeps its state (its publish cap still
        applies) and completes with the tokens reused so far."""
        self.decided.add(rid)
        state = self.requests.get(rid)
        if state is not None:
            state.decline(reason)
            self._drop_ended((state,))

    def _drop_ended(self, states: tuple[RequestReuse, ...]) -> None:
        """Forget the plans among ``states`` that ended with nothing copied (they are decided:
        not planned again until released)."""
        for state in states:
            if state.ended and self.requests.get(state.rid) is state:
                del self.requests[state.rid]
                self.decided.add(state.rid)

    def decided_at_arrival(self, rid: str) -> None:
        """``rid`` was decided outside the match hooks (substitute mode at arrival): they leave
        it alone until it is released."""
        self.decided.add(rid)

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
        """The request ended (finished, aborted or retracted): its plan completes (a request
        that reused KV and had not yet recorded its outcome is materialized with the tokens it
        reused) and is forgotten, with its decision."""
        state = self.requests.pop(rid, None)
        if state is not None:
            state.complete()
            if state.reused_any:
                label = state.settings.label
                self.runtime.count_settings(label, "materialized")
                self.runtime.count_settings(label, "reused_tokens", state.reused_total)
                self.runtime.count_settings(label, "recomputed_tokens", state.recomputed)
        self.decided.discard(rid)
        self.donors.release(rid)
        self.runtime.provider.release(rid)
