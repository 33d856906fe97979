"""Where resident donors hold parts of a prompt: for each asked ``[start, end)`` bound, the donor
that aligns with most of it and the donor position its first token aligns with.

The passage-order choice asks it (:meth:`.provider.SemanticProvider.locate`, from the
scheduler's arrival hook) so that a request's remaining passages can be put in donor runs
(:func:`.passages.donor_runs`). It searches as a lookup does (the same candidate search,
:func:`.candidate_search.search_candidates`, and counted work budget) and keeps nothing: no
decision, no outcome, no donor touched. Deterministic, so every rank fed the same calls
answers alike. Example::

    asked = LocateParams(namespace, prompt, bounds=((12, 310), (310, 598)))
    provider.locate(asked).sources  # (SpanSource(donor=0, start=40), None): 2nd in no donor
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .candidate_search import search_candidates
from .chunking import as_token_array
from .config import Config
from .donor_record import Candidate
from .index import TokenIndex
from .lookup_budget import LookupBudget
from .namespace import Namespace


@dataclass(frozen=True, slots=True)
class SpanSource:
    """One bound's place in a donor: ``donor``, the donor's rank among the search's candidates
    (0: the one sharing most chunks with the prompt), and ``start``, the donor position the
    bound's first token aligns with (along the shift of the span that covers most of it)."""

    donor: int
    start: int


@dataclass(frozen=True, slots=True)
class LocateParams:
    """What :func:`locate_bounds` is asked: the ``bounds`` (``[start, end)`` token positions,
    inside ``token_ids``) of a prompt ``token_ids`` in ``namespace``."""

    namespace: Namespace
    token_ids: Sequence[int] | np.ndarray
    bounds: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Located:
    """:func:`locate_bounds`'s answer: ``sources[i]`` is where a donor holds bound ``i`` (at
    least half of it aligned), or None."""

    sources: tuple[SpanSource | None, ...]

    @classmethod
    def nowhere(cls, bounds: int) -> Located:
        """No bound of ``bounds`` held by any donor."""
        return cls((None,) * bounds)


DonorTokens = Callable[[Candidate], "np.ndarray | None"]
"""A candidate donor's tokens, or None when they are gone."""


def locate_bounds(
    index: TokenIndex, config: Config, params: LocateParams, donor_tokens: DonorTokens
) -> Located:
    """Align the part of ``params.token_ids`` the bounds cover with each candidate donor of
    ``index`` (best first, within ``config.lookup_budget_ms`` of counted work) and give each
    bound the donor span covering most of it (ties: the better candidate). Called by the
    provider only; may raise (the provider turns that into :meth:`Located.nowhere`)."""
    bounds = params.bounds
    if not bounds:
        return Located(())
    tokens = as_token_array(params.token_ids)
    lo = min(start for start, _ in bounds)
    hi = max(end for _, end in bounds)
    region = tokens[lo:hi]
    if region.size < config.min_span_tokens:
        return Located.nowhere(len(bounds))
    budget = LookupBudget(config.lookup_budget_ms)
    found = search_candidates(index, config, params.namespace, region, budget)
    if found.anchors is None:
        return Located.nowhere(len(bounds))
    anchors = found.anchors
    covered = [0] * len(bounds)
    sources: list[SpanSource | None] = [None] * len(bounds)
    for rank, cand in enumerate(found.candidates):
        donor = donor_tokens(cand)
        if donor is None:
            continue
        spans = budget.align(region, donor, anchors, config.min_span_tokens)
        if spans is None:
            break
        for span in spans:
            for i, (start, end) in enumerate(bounds):
                a, b = start - lo, end - lo
                overlap = min(b, span.target_end) - max(a, span.target_start)
                if overlap > covered[i]:
                    covered[i] = overlap
                    sources[i] = SpanSource(rank, span.donor_start + a - span.target_start)
    return Located(
        tuple(
            src if 2 * covered[i] >= end - start else None
            for i, (src, (start, end)) in enumerate(zip(sources, bounds, strict=True))
        )
    )
