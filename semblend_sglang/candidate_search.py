"""The first steps of every donor search over a prompt region: chunk it, read the index's
candidates, anchor it, each step paid from the search's counted work budget before it runs.

The provider's lookup (:meth:`.provider.SemanticProvider.lookup`) and its passage locate
(:func:`.locate.locate_bounds`) both start here, so both see the same candidates, best first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .align import Anchors, anchors_of
from .chunking import chunk_tokens, token_prefix
from .config import Config
from .donor_record import Candidate
from .index import TokenIndex
from .lookup_budget import LookupBudget
from .namespace import Namespace
from .plan import Reason


@dataclass(frozen=True, slots=True)
class CandidateSearch:
    """:func:`search_candidates`' answer: the region's ``candidates``, best first, and its
    ``anchors``; ``anchors`` is None exactly when there is no candidate, and ``missing`` then
    says why (``lookup_budget`` or ``no_donor``)."""

    candidates: list[Candidate]
    anchors: Anchors | None
    missing: str = ""


def search_candidates(
    index: TokenIndex,
    config: Config,
    namespace: Namespace,
    region: np.ndarray,
    budget: LookupBudget,
) -> CandidateSearch:
    """Chunk ``region``, read up to ``config.max_candidates`` donors of ``namespace`` sharing at
    least ``config.min_candidate_tokens`` with it, and anchor it when one was found, charging
    ``budget`` for the chunking and the postings first (the anchors share the chunking's
    prefix). Deterministic; called by the provider's lookup and by the passage locate."""
    if not budget.charge(budget.region_cost(int(region.size))):
        return CandidateSearch([], None, Reason.LOOKUP_BUDGET)
    # one polynomial prefix of the region serves both the chunk hashes and the anchors
    prefix = token_prefix(region)
    query = chunk_tokens(region, index.params, prefix=prefix)
    if not budget.charge(budget.candidates_cost(len(query), index.max_postings_per_key)):
        return CandidateSearch([], None, Reason.LOOKUP_BUDGET)
    candidates = index.candidates(
        namespace, query, limit=config.max_candidates, min_shared_tokens=config.min_candidate_tokens
    )
    if not candidates:
        return CandidateSearch([], None, Reason.NO_DONOR)
    return CandidateSearch(candidates, anchors_of(region, config.min_span_tokens, prefix=prefix))
