"""The reuse state of one request: its plan, how far it was materialized, what of it was
recomputed, and how it ended. Owned by :class:`~.request_flow.RequestFlow`; transitions are
methods, and the ending ones record the request's outcome exactly once."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from semblend_sglang.align import Span
from semblend_sglang.config import Config
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason, ReusePlan
from semblend_sglang.request_settings import RequestSettings

DEFAULT_SETTINGS = RequestSettings(Config())
"""The settings of a plan started without any (the built-in defaults)."""


class Outcomes(Protocol):
    """Where a request's outcome is recorded (the provider's ``record_*``; each records once per
    pending plan and returns False otherwise)."""

    def record_materialized(
        self, request_id: Hashable, reused_tokens: int, *, spans: int = 1, donors: int = 1
    ) -> bool: ...

    def record_declined(self, request_id: Hashable, reason: str = ...) -> bool: ...

    def record_cold_fallback(self, request_id: Hashable, where: str = ...) -> bool: ...


@dataclass(frozen=True)
class CheckOutcome:
    """What a check layer chose for request ``rid`` in one chunk (the hook reports it to
    :meth:`.RequestFlow.checked`): ``recomputed`` of the positions it copied (``gated``: all, by
    the quality gate), ``residual`` the mean deviation the budget left, ``rechecked`` when the
    second check layer chose them; ``final``: the chunk ends the prompt."""

    rid: str
    recomputed: int
    gated: bool
    residual: float
    final: bool
    rechecked: bool = False


class ReuseState(enum.Enum):
    """Where a request's reuse plan stands. Transitions are :class:`RequestReuse` methods.

    ``PLANNED`` (looked up, nothing copied) -> ``LOADING`` (spans inside the prefill chunks run
    so far were copied; later chunks may copy more) -> ``MATERIALIZED`` (no further span is
    copied; the outcome is recorded; the publish cap holds until release). A plan that ends with
    nothing copied is ``DECLINED`` (with a reason) or ``FAILED`` (an error: a cold fallback).
    """

    PLANNED = "planned"
    LOADING = "loading"
    MATERIALIZED = "materialized"
    DECLINED = "declined"
    FAILED = "failed"


@dataclass
class RequestReuse:
    """The reuse plan of one request and how far it got; owned by
    :class:`~.request_flow.RequestFlow`, which drops it once it :attr:`ended`.

    ``spans`` are in target order, ``donors[i]`` is span ``i``'s donor; ``heads[i]`` leading
    tokens of span ``i`` are recomputed instead of copied (``heads`` strategy; empty: none);
    ``settings``: the request's own (:mod:`semblend_sglang.request_settings`).
    ``handled_to``: target positions below it were offered for reuse already (copied or
    computed), so a later prefill chunk never copies them again. Once any KV was copied
    (``reused_any``) nothing from ``publish_cap`` (the first copied position) on may be
    published into the exact cache, even where a check later recomputed it.
    """

    rid: str
    outcomes: Outcomes
    namespace: Namespace
    plan: ReusePlan
    spans: tuple[Span, ...]
    donors: tuple[Hashable, ...]
    heads: tuple[int, ...] = ()
    settings: RequestSettings = DEFAULT_SETTINGS
    """The settings the request is served with (its own repair settings over the server's)."""
    state: ReuseState = ReuseState.PLANNED
    handled_to: int = 0
    reused_total: int = 0
    """Tokens whose donor KV is kept so far, over all spans (copied, less what a check layer
    recomputed)."""
    recomputed: int = 0
    """Reused positions recomputed instead (span heads, or selected at a check layer)."""
    gated: bool = False
    """The quality gate refused a chunk's reuse at its check layer."""
    loaded_pieces: tuple[tuple[Span, Hashable], ...] = ()
    """Every (span part, donor) copied so far, in copy order."""
    first_loaded: int | None = None

    @property
    def spans_loaded(self) -> int:
        """Span parts copied so far (a span split by a prefill chunk counts once per part)."""
        return len(self.loaded_pieces)

    @property
    def donors_loaded(self) -> frozenset[Hashable]:
        """Donors whose KV was copied."""
        return frozenset(d for _, d in self.loaded_pieces)

    # ------------------------------------------------------------- reading
    @property
    def publish_cap(self) -> int:
        """The request publishes nothing from here on once it reused KV: the first copied
        position (the first span's start before anything was copied)."""
        return self.spans[0].target_start if self.first_loaded is None else self.first_loaded

    @property
    def reused_any(self) -> bool:
        """True once at least one span's KV was copied into the request's slots."""
        return self.first_loaded is not None

    @property
    def checks_at_layer(self) -> bool:
        """True when the request's strategy selects at a check layer (deviation, query)."""
        return self.settings.config.recompute_strategy.uses_check_layer

    @property
    def open(self) -> bool:
        """True while a later prefill chunk may still copy spans (PLANNED or LOADING)."""
        return self.state in (ReuseState.PLANNED, ReuseState.LOADING)

    def pieces_within(self, lo: int, hi: int) -> list[tuple[Span, Hashable]]:
        """The parts of not yet handled spans inside target positions [lo, hi), with donors."""
        lo = max(lo, self.handled_to)
        out: list[tuple[Span, Hashable]] = []
        for i, (span, donor) in enumerate(zip(self.spans, self.donors, strict=True)):
            head = self.heads[i] if self.heads else 0
            a = max(span.target_start + head, lo)
            b = min(span.target_end, hi)
            if b > a:
                out.append((Span(a, span.donor_start + a - span.target_start, b - a), donor))
        return out

    # ------------------------------------------------------------- transitions
    def loaded(self, pieces: list[tuple[Span, Hashable]], handled_to: int) -> None:
        """PLANNED/LOADING -> LOADING: ``pieces`` were copied into the request's slots;
        target positions below ``handled_to`` are done with."""
        self._expect(ReuseState.PLANNED, ReuseState.LOADING)
        self.state = ReuseState.LOADING
        self._handle(handled_to)
        for span, _ in pieces:
            if self.first_loaded is None or span.target_start < self.first_loaded:
                self.first_loaded = span.target_start
            self.reused_total += span.length
        self.loaded_pieces = self.loaded_pieces + tuple(pieces)

    def skipped(self, handled_to: int) -> None:
        """Target positions below ``handled_to`` were computed, nothing copied (state kept)."""
        self._expect(ReuseState.PLANNED, ReuseState.LOADING)
        self._handle(handled_to)

    def _handle(self, handled_to: int) -> None:
        """Advance ``handled_to``; the span heads passed are counted as recomputed."""
        self.recomputed += self.heads_within(self.handled_to, handled_to)
        self.handled_to = max(self.handled_to, handled_to)

    def computed_within(self, lo: int, hi: int, kept_share: float = 1.0) -> int:
        """Positions of a prefill chunk [lo, hi) that the one-pass extend computes: all but
        ``kept_share`` of the parts of not yet handled spans inside [lo, hi - 1) (a chunk's last
        position is always computed; a check-layer strategy recomputes the rest of them after
        its check layer). Non-decreasing in ``hi``."""
        reused = sum(span.length for span, _ in self.pieces_within(lo, hi - 1))
        return hi - lo - int(reused * kept_share)

    def chunk_end(self, lo: int, end: int, budget: int, kept_share: float = 1.0) -> int:
        """The largest ``hi`` in [lo + 1, end] whose chunk [lo, hi) computes at most ``budget``
        positions (:meth:`computed_within`; lo + 1 when even one position is over it): where a
        prefill chunk that charges computed positions may stop."""
        if end <= lo + 1 or self.computed_within(lo, end, kept_share) <= budget:
            return max(end, lo + 1)
        low, high = lo + 1, end  # computed(low) <= budget (or nothing fits), computed(high) > it
        while high - low > 1:
            mid = (low + high) // 2
            if self.computed_within(lo, mid, kept_share) <= budget:
                low = mid
            else:
                high = mid
        return low

    def heads_within(self, lo: int, hi: int) -> int:
        """Positions of span heads (recomputed by the ``heads`` strategy) inside [lo, hi) not
        yet handled."""
        if not self.heads:
            return 0
        lo = max(lo, self.handled_to)
        return sum(
            max(0, min(span.target_start + head, hi) - max(span.target_start, lo))
            for span, head in zip(self.spans, self.heads, strict=True)
        )

    def checked(self, recomputed: int, gated: bool) -> None:
        """LOADING/MATERIALIZED: a check layer recomputed ``recomputed`` of the positions
        copied in a chunk (all of them when ``gated``); their donor KV is no longer used."""
        self._expect(ReuseState.LOADING, ReuseState.MATERIALIZED)
        self.reused_total -= recomputed
        self.recomputed += recomputed
        self.gated = self.gated or gated

    @property
    def ended(self) -> bool:
        """True once the plan ended with nothing copied (DECLINED or FAILED): nothing of it
        binds the request any more, so its owner forgets it."""
        return self.state in (ReuseState.DECLINED, ReuseState.FAILED)

    def complete(self) -> None:
        """-> MATERIALIZED, recording the outcome once: no further span is copied (terminal
        while the request lives). Materialized with the tokens whose donor KV was kept, or
        ``declined:quality_gate`` where the gate had every copied position recomputed. No-op for
        a plan that copied nothing (its owner declines it, or the provider counts it
        ``unreported`` at release) and for one already complete."""
        if not self.reused_any or self.state is ReuseState.MATERIALIZED:
            return
        self.state = ReuseState.MATERIALIZED
        if self.gated and self.reused_total <= 0:
            self.outcomes.record_declined(self.rid, Reason.QUALITY_GATE)
        else:
            self.outcomes.record_materialized(
                self.rid, self.reused_total, spans=self.spans_loaded, donors=len(self.donors_loaded)
            )

    def decline(self, reason: str) -> None:
        """The engine will not use (the rest of) the plan, for ``reason``. A plan that already
        copied KV completes instead (materialized with what it kept; its publish cap stays);
        otherwise -> DECLINED, recorded once."""
        if self.reused_any:
            self.complete()
        elif not self.ended:
            self.state = ReuseState.DECLINED
            self.outcomes.record_declined(self.rid, reason)

    def fail(self, where: str) -> bool:
        """An error in the semantic path at ``where``: a plan that copied KV completes with what
        it kept (returns False: the error is not the request's outcome); otherwise -> FAILED,
        recorded once as a cold fallback (returns True)."""
        if self.reused_any:
            self.complete()
            return False
        if not self.ended:
            self.state = ReuseState.FAILED
            self.outcomes.record_cold_fallback(self.rid, where)
        return True

    def _expect(self, *allowed: ReuseState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"reuse of {self.rid}: {self.state.value} is not one of {allowed}")
