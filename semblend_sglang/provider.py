"""SemanticProvider: the one object every engine path shares to find donors and plan reuse.

Engines call :meth:`SemanticProvider.register` when a request's KV becomes a donor,
:meth:`~SemanticProvider.lookup` when a request is matched (SGLang calls it at every scheduling
step: the first decision per request id is cached, later calls cost a dict lookup),
:meth:`~SemanticProvider.record_materialized` / ``record_declined`` / ``record_cold_fallback``
after acting on a plan, :meth:`~SemanticProvider.release` when the request ends and
:meth:`~SemanticProvider.forget` when a donor's KV is evicted; the passage order asks
:meth:`~SemanticProvider.locate` where donors hold a prompt's passages. No method raises into the
engine: an internal error becomes a decline (``cold_fallback``), counted and logged once.
Decisions depend only on the calls made (no clock, no randomness, no string ``hash()``): every
tensor-parallel rank fed the same calls decides the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from .align import Anchors, Span
from .candidate_search import search_candidates
from .chunking import ChunkParams, as_token_array
from .config import Config
from .decisions import MAX_CACHED_REQUESTS, RequestDecisions
from .donor_record import Candidate
from .embed import DonorSimilarity, WindowedEmbedder, load_embedder
from .index import TokenIndex
from .locate import Located, LocateParams, locate_bounds
from .lookup_budget import LookupBudget
from .lookup_params import Detokenize, LookupParams, TokenSource
from .namespace import Namespace
from .once_log import OnceLog
from .plan import Decision, Reason, build_plan, cover, plans_several_donors, prefilter
from .telemetry import Telemetry

logger = logging.getLogger(__name__)


class SemanticProvider:
    """Finds donors for a request and plans their reuse; shared by all engine integrations.

    ``token_source``: how the provider reads a donor's tokens back from the engine (None: the index
    keeps an int32 copy of each donor's tokens). ``registry``: prometheus registry for the
    ``semblend_*`` series (None: the global one). ``detokenize`` and ``embedder`` serve the
    substitute-mode similarity gate and discovery telemetry only; with embedder "minilm" and no
    ``embedder`` given, it is loaded here (once per process) when the mode needs it.
    Thread-safe.
    """

    def __init__(
        self,
        config: Config,
        token_source: TokenSource | None = None,
        *,
        registry: Any = None,
        telemetry: Telemetry | None = None,
        detokenize: Detokenize | None = None,
        embedder: WindowedEmbedder | None = None,
        max_cached_requests: int = MAX_CACHED_REQUESTS,
    ) -> None:
        self.config = config
        self.telemetry = telemetry if telemetry is not None else Telemetry(registry)
        self._token_source = token_source
        self.index = TokenIndex(
            ChunkParams.for_avg(config.chunk_avg_tokens),
            config.max_donors,
            keep_tokens=token_source is None,
            max_bytes=config.max_index_bytes,
        )
        self.decisions = RequestDecisions(self.telemetry, max_cached_requests)
        self._failures = OnceLog(logger)
        needs_embedder = config.embedder == "minilm" and (
            config.mode == "substitute" or (config.discovery_only and config.embed_discovery)
        )
        if embedder is None and needs_embedder:
            embedder = self._guard("embedder", lambda: load_embedder(config.embedder))
        self._similarity = DonorSimilarity(embedder, detokenize)

    # ------------------------------------------------------------------ donors
    def register(
        self, namespace: Namespace, handle: Hashable, token_ids: Sequence[int]
    ) -> list[Hashable]:
        """Make ``token_ids`` (whose KV the engine holds under ``handle``) a donor in ``namespace``.
        Re-registering a handle replaces it. Donors shorter than ``min_span_tokens`` are not kept.
        May evict the least recently used donors: returns their handles (the engine may drop
        what it keeps for them). Never raises."""

        def work() -> list[Hashable]:
            if not self.config.enabled:
                return []
            tokens = as_token_array(token_ids)
            if tokens.size < self.config.min_span_tokens:
                return []
            evicted = self.index.register(namespace, handle, tokens)
            for gone in evicted:
                self._similarity.forget(gone)
            self.telemetry.set_donors(len(self.index))
            return evicted

        dropped: list[Hashable] | None = self._guard("register", work)
        return dropped or []

    def has_donor(self, handle: Hashable) -> bool:
        """True while ``handle`` is a registered donor."""
        return handle in self.index

    def forget(self, handle: Hashable) -> None:
        """Drop donor ``handle`` (its KV is gone). Unknown handles are ignored. Never raises."""
        self._guard("forget", lambda: self._drop_donor(handle))

    def donor_tokens(self, handle: Hashable) -> np.ndarray | None:
        """Tokens of donor ``handle``: the index's copy, else the token source's answer; None
        when the donor is not registered or its KV is gone. Never raises."""

        def work() -> np.ndarray | None:
            kept = self.index.tokens_of(handle)
            if kept is not None:
                return kept
            if self._token_source is None or handle not in self.index:
                return None
            got = self._token_source(handle)
            return None if got is None else as_token_array(got)

        result: np.ndarray | None = self._guard("donor_tokens", work)
        return result

    # ------------------------------------------------------------------ lookup
    def lookup(self, params: LookupParams) -> Decision:
        """Decide how request ``params.request_id`` should prefill: exact, plan or decline.

        A candidate donor with fewer than ``min_span_tokens`` tokens ``params.alive`` is reported
        to ``params.gone`` (which forgets it) and the next one tried; another is aligned over
        what is left.

        The first decision for a request id is cached until :meth:`release`; later calls return it
        at the cost of a dict lookup (``request_id=None`` disables caching). exact and decline
        decisions record the request's outcome at once; a plan's outcome is recorded when the
        engine reports it. Never raises: errors give ``Decision("decline", "cold_fallback")``.
        """
        request_id = params.request_id
        if request_id is not None:
            cached = self.decisions.get(request_id)
            if cached is not None:
                return cached
        started = time.perf_counter()
        try:
            decision = self._decide(params)
        except Exception as exc:
            self._failures.log("lookup", exc)
            self.telemetry.record_error("lookup")
            decision = Decision.decline(Reason.COLD_FALLBACK)
        self.telemetry.observe_lookup(time.perf_counter() - started)
        if request_id is None:
            self.decisions.record_final(decision)
            return decision
        return self.decisions.keep(request_id, decision)

    def locate(self, params: LocateParams) -> Located:
        """Where resident donors hold each of ``params.bounds`` (:func:`.locate.locate_bounds`);
        keeps nothing, counts only its errors, never raises (an error locates nothing)."""
        args = (self.index, self.config, params, self._donor_tokens)
        found: Located | None = self._guard("locate", lambda: locate_bounds(*args))
        return found or Located.nowhere(len(params.bounds))

    def decline_request(self, request_id: Hashable, reason: str) -> Decision:
        """Decide ``request_id`` as declined with ``reason`` without a lookup (the request asked
        for no reuse): kept and recorded like a lookup's decline, once per request id; a
        request already decided keeps its first decision. Never raises."""
        return self.decisions.keep(request_id, Decision.decline(reason))

    def release(self, request_id: Hashable) -> None:
        """Forget the cached decision of a finished request. A plan whose outcome the engine did
        not report is counted as declined (``unreported``). Never raises."""
        self.decisions.release(request_id)

    # ------------------------------------------------------------------ outcomes
    def record_materialized(
        self, request_id: Hashable, reused_tokens: int, *, spans: int = 1, donors: int = 1
    ) -> bool:
        """The engine materialized ``reused_tokens`` donor tokens of the request's plan, in
        ``spans`` spans read from ``donors`` distinct donors. Returns False (and records
        nothing) when the request has no pending plan."""
        return self.decisions.report(request_id, "materialized", None, reused_tokens, spans, donors)

    def record_declined(self, request_id: Hashable, reason: str = Reason.ENGINE_DECLINED) -> bool:
        """The engine did not use the request's plan (``reason``, e.g. capacity or stale donor).
        Returns False when the request has no pending plan."""
        return self.decisions.report(request_id, "declined", reason, 0)

    def record_cold_fallback(self, request_id: Hashable, where: str = "engine") -> bool:
        """Materializing the request's plan failed; the engine fell back to a normal prefill.
        Returns False when the request has no pending plan."""
        reported = self.decisions.report(request_id, "cold_fallback", None, 0)
        if reported:
            self.telemetry.record_error(where)
        return reported

    def snapshot(self) -> dict[str, Any]:
        """Telemetry snapshot plus index statistics and the number of pending plans."""
        snap = self.telemetry.snapshot()
        snap["index"] = self.index.stats()
        snap.update(self.decisions.counts())
        return snap

    # ------------------------------------------------------------------ internals
    def _decide(self, params: LookupParams) -> Decision:
        config = self.config
        tokens = as_token_array(params.token_ids)
        n = int(tokens.size)
        exact_len = min(max(int(params.exact_len), 0), n)
        page_size = params.page_size
        early = prefilter(config, n, exact_len)
        if early is not None:
            return early
        region = tokens[exact_len:]
        budget = LookupBudget(config.lookup_budget_ms)
        found = search_candidates(self.index, config, params.namespace, region, budget)
        if found.anchors is None:
            return Decision.decline(found.missing)
        candidates, anchors = found.candidates, found.anchors
        if plans_several_donors(config):
            return self._multi_donor_plan(
                tokens, region, anchors, exact_len, page_size, candidates, budget, params
            )
        first_decline: Decision | None = None
        for cand in candidates:
            donor = self._live_donor_tokens(cand, params)
            if donor is None:
                if first_decline is None:
                    first_decline = Decision.decline(Reason.DONOR_EVICTED)
                continue
            found = budget.align(region, donor, anchors, self.config.min_span_tokens)
            if found is None:
                first_decline = first_decline or Decision.decline(Reason.LOOKUP_BUDGET)
                break
            decision = self._plan_for(tokens, exact_len, page_size, cand, donor, found)
            if decision.kind == "plan":
                if config.discovery_only:
                    return Decision.decline(Reason.DISCOVERY_ONLY, evidence=decision.plan)
                self.index.touch(cand.handle)
                return decision
            if first_decline is None or first_decline.reason == Reason.DONOR_EVICTED:
                first_decline = decision
        assert first_decline is not None
        return first_decline

    def _multi_donor_plan(
        self,
        tokens: np.ndarray,
        region: np.ndarray,
        anchors: Anchors,
        exact_len: int,
        page_size: int,
        candidates: list[Candidate],
        budget: LookupBudget,
        params: LookupParams,
    ) -> Decision:
        """Align the region with each candidate (best first) until ``max_plan_donors`` donors
        contributed, nothing long enough is left uncovered or the budget is spent, then cover
        the target with the longest spans of any of them (:func:`.plan.cover`)."""
        config = self.config
        found: list[tuple[Hashable, tuple[Span, ...]]] = []
        cands: dict[Hashable, Candidate] = {}
        covered = np.zeros(region.size, dtype=bool)
        evicted = spent = False
        for cand in candidates:
            donor = self._live_donor_tokens(cand, params)
            if donor is None:
                evicted = True
                continue
            spans = budget.align(region, donor, anchors, self.config.min_span_tokens)
            if spans is None:
                spent = True
                break
            new = [s for s in spans if not covered[s.target_start : s.target_end].all()]
            if not new:
                continue
            found.append((cand.handle, tuple(new)))
            cands[cand.handle] = cand
            for s in new:
                covered[s.target_start : s.target_end] = True
            if len(found) >= config.max_plan_donors:
                break
            if int(region.size - covered.sum()) < config.min_span_tokens + config.sink_tokens:
                break
        if not found:
            if spent:
                return Decision.decline(Reason.LOOKUP_BUDGET)
            return Decision.decline(Reason.DONOR_EVICTED if evicted else Reason.NO_ALIGNMENT)
        spans, donors = cover(found, min_length=config.min_span_tokens)
        first = cands[found[0][0]]
        decision = self._gate(tokens, exact_len, page_size, first, spans, span_donors=donors)
        if decision.kind != "plan" or decision.plan is None:
            return decision
        if config.discovery_only:
            return Decision.decline(Reason.DISCOVERY_ONLY, evidence=decision.plan)
        for handle in decision.plan.donors:
            self.index.touch(handle)
        return decision

    def _live_donor_tokens(self, cand: Candidate, params: LookupParams) -> np.ndarray | None:
        """The candidate's tokens whose KV the engine still holds (``params.alive``), or None,
        the donor reported gone (``params.gone``), when too few are left to hold a span or the
        token source has none."""
        donor = self._donor_tokens(cand)
        if donor is not None and params.alive is not None:
            left = int(params.alive(cand.handle, donor))
            donor = donor[:left] if left >= self.config.min_span_tokens else None
        if donor is None and (cand.tokens is not None or self._token_source is not None):
            (params.gone or self._drop_donor)(cand.handle)
        return donor

    def _donor_tokens(self, cand: Candidate) -> np.ndarray | None:
        if cand.tokens is not None:
            return cand.tokens
        if self._token_source is None:
            return None
        got = self._token_source(cand.handle)
        return None if got is None else as_token_array(got)

    def _plan_for(
        self,
        tokens: np.ndarray,
        exact_len: int,
        page_size: int,
        cand: Candidate,
        donor: np.ndarray,
        found: tuple[Span, ...],
    ) -> Decision:
        config = self.config
        similarity: float | None = None
        if config.mode == "substitute":
            if config.embedder == "jaccard":
                similarity = cand.sketch_similarity
            elif config.embedder == "minilm":
                similarity = self._similarity(tokens, cand.handle, donor)
                if similarity is None:
                    return Decision.decline(Reason.NO_EMBEDDER)
            if similarity is not None and similarity < config.min_similarity:
                return Decision.decline(Reason.SIMILARITY_LOW)
        elif config.discovery_only and config.embed_discovery:
            similarity = self._similarity(tokens, cand.handle, donor)
            if similarity is not None:
                self.telemetry.observe_similarity(similarity)
        return self._gate(tokens, exact_len, page_size, cand, found, similarity=similarity)

    def _gate(
        self,
        tokens: np.ndarray,
        exact_len: int,
        page_size: int,
        lead: Candidate,
        found: tuple[Span, ...],
        **extra: Any,
    ) -> Decision:
        """:func:`.plan.build_plan` for the spans ``found`` in the region after the exact hit
        (shifted by ``exact_len`` into target positions), ``lead`` naming the plan's donor;
        ``extra``: ``similarity`` or ``span_donors``."""
        spans = found
        if exact_len:
            spans = tuple(Span(s.target_start + exact_len, s.donor_start, s.length) for s in found)
        return build_plan(
            self.config,
            spans=spans,
            n_tokens=int(tokens.size),
            exact_len=exact_len,
            page_size=page_size,
            donor_handle=lead.handle,
            donor_namespace=lead.namespace,
            **extra,
        )

    def _drop_donor(self, handle: Hashable) -> None:
        """Forget donor ``handle`` everywhere the provider keeps something of it."""
        self.index.forget(handle)
        self._similarity.forget(handle)
        self.telemetry.set_donors(len(self.index))

    def _guard(self, where: str, work: Callable[[], Any]) -> Any:
        try:
            return work()
        except Exception as exc:
            self._failures.log(where, exc)
            self.telemetry.record_error(where)
            return None
