"""Planner: aligned spans -> Decision: exact, plan (spans with position deltas) or decline.

Pure functions of their arguments (no clock, no randomness, no engine calls). Gates, in order:
prompt length (``min_prompt_tokens``), exact coverage already sufficient
(``exact_sufficient_ratio``), then per span: start at or after the exact hit, skip ``sink_tokens``
(recomputed at each span start), round the target start up and the end down to ``page_size``, and
leave at least the last prompt token to compute; keep at most ``max_spans`` spans (one when
``strict_prefix_boundary``), longest first; then ``min_reuse_tokens`` and ``min_reuse_ratio``.
Spans may come from several donors (:func:`cover`): each planned span names its donor.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

from .align import Span
from .config import Config
from .namespace import Namespace


class Reason(enum.StrEnum):
    """Decision and outcome reasons (closed set; also the telemetry ``reason`` label values).
    Members are strings: they compare, hash, format and serialize as their values."""

    EXACT_SUFFICIENT = "exact_sufficient"
    DISABLED = "disabled"
    PROMPT_TOO_SHORT = "prompt_too_short"
    NO_DONOR = "no_donor"
    DONOR_EVICTED = "donor_evicted"
    NO_ALIGNMENT = "no_alignment"
    SPANS_TRIMMED_AWAY = "spans_trimmed_away"
    REUSE_TOO_SMALL = "reuse_too_small"
    REUSE_RATIO_LOW = "reuse_ratio_low"
    SIMILARITY_LOW = "similarity_low"
    NO_EMBEDDER = "no_embedder"
    DISCOVERY_ONLY = "discovery_only"
    COLD_FALLBACK = "cold_fallback"
    PLANNED = "planned"
    ENGINE_DECLINED = "engine_declined"
    UNREPORTED = "unreported"
    UNSUPPORTED_CACHE = "unsupported_cache"
    DONOR_ON_HOST = "donor_on_host"
    ABORTED = "aborted"
    NOT_AT_BOUNDARY = "not_at_boundary"
    LOOKUP_BUDGET = "lookup_budget"
    RANK_DISAGREEMENT = "rank_disagreement"
    QUALITY_GATE = "quality_gate"
    UNSUPPORTED_MODEL = "unsupported_model"
    OPTED_OUT = "opted_out"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """What the engine materializes: for span ``i``, the KV of donor ``donor_of(i)`` at
    ``donor_start + x`` becomes the request's KV at ``target_start + x`` (K rotated by
    ``span.delta``).

    Spans are already trimmed (sink tokens removed, page-aligned target starts and ends, last
    prompt token left to compute), sorted by ``target_start``, and do not overlap in the target
    (nor in a donor, for spans of the same donor). ``donor_handle`` is the donor of the most
    reused tokens; ``span_donors`` (empty: every span is ``donor_handle``'s) names each span's.
    ``similarity`` is the substitute-mode gate value, or None.
    """

    donor_handle: Hashable
    donor_namespace: Namespace
    spans: tuple[Span, ...]
    reused_tokens: int
    prompt_tokens: int
    exact_len: int
    page_size: int
    substitute: bool = False
    similarity: float | None = None
    span_donors: tuple[Hashable, ...] = ()

    def donor_of(self, i: int) -> Hashable:
        """The donor whose KV span ``i`` reuses."""
        return self.span_donors[i] if self.span_donors else self.donor_handle

    @property
    def donors(self) -> tuple[Hashable, ...]:
        """Every donor of the plan, once each, in order of first use in the target."""
        return tuple(dict.fromkeys(self.donor_of(i) for i in range(len(self.spans))))

    @property
    def first_reused(self) -> int:
        """Target position where reuse starts (the engine computes [exact_len, first_reused))."""
        return self.spans[0].target_start

    @property
    def reuse_ratio(self) -> float:
        """reused tokens / tokens not covered by the exact hit."""
        return self.reused_tokens / max(1, self.prompt_tokens - self.exact_len)


class DecisionKind(enum.StrEnum):
    """What a lookup decided (:attr:`Decision.kind`)."""

    EXACT = "exact"
    PLAN = "plan"
    DECLINE = "decline"


@dataclass(frozen=True, slots=True)
class Decision:
    """Result of a lookup. ``kind``: exact (let the engine's exact path run), plan (materialize
    ``plan``), decline (run the normal prefill; ``reason`` says why). ``plan`` is set iff the
    kind is a plan (ValueError otherwise); ``evidence`` carries the plan that was found but not
    to be materialized (discovery_only mode). Build with :meth:`exact`, :meth:`decline` or
    :func:`build_plan`."""

    kind: DecisionKind
    reason: str
    plan: ReusePlan | None = None
    evidence: ReusePlan | None = field(default=None, compare=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", DecisionKind(self.kind))
        if (self.kind is DecisionKind.PLAN) != (self.plan is not None):
            raise ValueError(
                f"a {self.kind} decision {'needs' if self.plan is None else 'may not carry'} a plan"
            )

    @staticmethod
    def exact(reason: str = Reason.EXACT_SUFFICIENT) -> Decision:
        """The exact route."""
        return Decision(DecisionKind.EXACT, reason)

    @staticmethod
    def decline(reason: str, evidence: ReusePlan | None = None) -> Decision:
        """A decline with its reason."""
        return Decision(DecisionKind.DECLINE, reason, None, evidence)


def plans_several_donors(config: Config) -> bool:
    """True when a lookup under ``config`` may cover one target with spans of several donors
    (``max_plan_donors`` > 1, and neither a strict prefix boundary, substitute mode nor
    embedding discovery, which judge one donor at a time)."""
    return (
        config.max_plan_donors > 1
        and not config.strict_prefix_boundary
        and config.mode != "substitute"
        and not (config.discovery_only and config.embed_discovery)
    )


def prefilter(config: Config, n_tokens: int, exact_len: int) -> Decision | None:
    """Gates that need no donor: disabled, prompt too short, exact coverage sufficient.

    Returns the Decision when one applies, else None (go on and look for a donor).
    """
    if not config.enabled:
        return Decision.decline(Reason.DISABLED)
    if n_tokens < max(config.min_prompt_tokens, 2):
        return Decision.decline(Reason.PROMPT_TOO_SHORT)
    if exact_len >= n_tokens or exact_len >= config.exact_sufficient_ratio * n_tokens:
        return Decision.exact()
    return None


def _ceil(x: int, page: int) -> int:
    return -(-x // page) * page


def trim_spans(
    spans: tuple[Span, ...],
    *,
    n_tokens: int,
    exact_len: int,
    page_size: int,
    sink_tokens: int,
) -> tuple[Span, ...]:
    """Apply the per-span gates: start >= exact_len, drop ``sink_tokens`` at each span start,
    page-align the target start (up) and end (down), end <= n_tokens - 1. Empty spans are dropped.
    The donor side moves with the target side (same delta)."""
    return tuple(
        span
        for span, _ in _trim_with_donors(
            spans, (None,) * len(spans), n_tokens, exact_len, page_size, sink_tokens
        )
    )


def _trim_with_donors(
    spans: tuple[Span, ...],
    donors: tuple[Hashable, ...],
    n_tokens: int,
    exact_len: int,
    page_size: int,
    sink_tokens: int,
) -> list[tuple[Span, Hashable]]:
    out: list[tuple[Span, Hashable]] = []
    last_end = (n_tokens - 1) // page_size * page_size
    for span, donor in zip(spans, donors, strict=True):
        start = max(span.target_start, exact_len) + sink_tokens
        start = _ceil(start, page_size)
        end = min(span.target_end, last_end) // page_size * page_size
        if end - start <= 0:
            continue
        shift = start - span.target_start
        out.append((Span(start, span.donor_start + shift, end - start), donor))
    return out


def cover(
    found: list[tuple[Hashable, tuple[Span, ...]]], *, min_length: int
) -> tuple[tuple[Span, ...], tuple[Hashable, ...]]:
    """Cover the target with spans of several donors: ``found`` lists each donor's aligned spans
    (donors best first). Longest first (ties: earlier donor, then smaller target start), a span
    keeps only its pieces not yet covered in the target that are at least ``min_length`` long.
    Returns the chosen spans sorted by target start and their donors. Pure."""
    ranked = sorted(
        ((span, rank, donor) for rank, (donor, spans) in enumerate(found) for span in spans),
        key=lambda item: (-item[0].length, item[1], item[0].target_start),
    )
    covered: list[tuple[int, int]] = []  # disjoint target intervals, sorted
    chosen: list[tuple[Span, Hashable]] = []
    for span, _, donor in ranked:
        pieces: list[Span] = []
        at = span.target_start
        for lo, hi in [*covered, (span.target_end, span.target_end)]:
            if hi <= at:
                continue
            end = min(lo, span.target_end)
            if end - at >= min_length:
                pieces.append(Span(at, span.donor_start + at - span.target_start, end - at))
            at = max(at, hi)
            if at >= span.target_end:
                break
        chosen.extend((piece, donor) for piece in pieces)
        covered = sorted([*covered, *((p.target_start, p.target_end) for p in pieces)])
    chosen.sort(key=lambda item: item[0].target_start)
    return tuple(s for s, _ in chosen), tuple(d for _, d in chosen)


def build_plan(
    config: Config,
    *,
    spans: tuple[Span, ...],
    n_tokens: int,
    exact_len: int,
    page_size: int,
    donor_handle: Hashable,
    donor_namespace: Namespace,
    similarity: float | None = None,
    span_donors: tuple[Hashable, ...] = (),
) -> Decision:
    """Gate aligned ``spans`` (target positions, maximal identical runs, not overlapping in the
    target) into a plan or a decline. ``span_donors`` names each span's donor (empty: all are
    ``donor_handle``'s); the plan's ``donor_handle`` becomes the donor of the most kept tokens.

    Does not apply :func:`prefilter` (the caller does, first). Never returns an exact decision.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not spans:
        return Decision.decline(Reason.NO_ALIGNMENT)
    donors = span_donors or (donor_handle,) * len(spans)
    trimmed = _trim_with_donors(spans, donors, n_tokens, exact_len, page_size, config.sink_tokens)
    if not trimmed:
        return Decision.decline(Reason.SPANS_TRIMMED_AWAY)
    limit = 1 if config.strict_prefix_boundary else config.max_spans
    kept = sorted(trimmed, key=lambda item: (-item[0].length, item[0].target_start))[:limit]
    kept.sort(key=lambda item: item[0])
    reused = sum(s.length for s, _ in kept)
    per_donor: dict[Hashable, int] = {}
    for s, d in kept:
        per_donor[d] = per_donor.get(d, 0) + s.length
    main = max(per_donor, key=lambda d: per_donor[d])  # first such donor on ties (dict order)
    kept_donors = tuple(d for _, d in kept)
    if reused < config.min_reuse_tokens:
        return Decision.decline(Reason.REUSE_TOO_SMALL)
    if reused < config.min_reuse_ratio * (n_tokens - exact_len):
        return Decision.decline(Reason.REUSE_RATIO_LOW)
    plan = ReusePlan(
        donor_handle=main,
        donor_namespace=donor_namespace,
        spans=tuple(s for s, _ in kept),
        reused_tokens=reused,
        prompt_tokens=n_tokens,
        exact_len=exact_len,
        page_size=page_size,
        substitute=config.mode == "substitute",
        similarity=similarity,
        span_donors=() if len(per_donor) == 1 else kept_donors,
    )
    return Decision(DecisionKind.PLAN, Reason.PLANNED, plan)
