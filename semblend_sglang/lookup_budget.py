"""The work budget of one provider lookup, counted in operations rather than measured in time.

A lookup runs in the engine's scheduler loop, so it must stay short on any input (a 100K-token
prompt, one token repeated, a chunk shared with a thousand donors). Tensor-parallel ranks must
also decide alike (no timing in a decision), so the budget is counted, deterministically, in
work units that approximate nanoseconds on this project's reference CPU: ``lookup_budget_ms``
milliseconds are ``lookup_budget_ms * WORK_UNITS_PER_MS`` units, and each step of a lookup is
charged its worst-case cost before it runs; an alignment, charged for the most anchor pairs and
diagonals it may use, is refunded what it did not use once it ran (its counts are deterministic),
so that later donors of the same lookup are not starved by a reservation. A lookup whose next step
does not fit stops there: with no plan yet, the request goes on cold (``lookup_budget``,
counted); otherwise the plan found so far stands.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .align import AlignLimits, Span, measured_align
from .anchors import Anchors

WORK_UNITS_PER_MS = 1_000_000
"""Work units in one millisecond of the reference CPU (one unit is about a nanosecond). The
per-step costs below were measured there (2-core AMD EPYC, AVX2, numpy; ``python -m
semblend_sglang.bench adversarial``): every step is charged at or above its wall time on the
worst stream, so a lookup's wall time stays within its budget."""

REGION_UNITS_PER_TOKEN = 15
"""Units per target token for chunking, anchoring and prefix-hashing the lookup's region."""

DONOR_UNITS_PER_TOKEN = 40
"""Units per donor token of one alignment's fixed work: the donor's prefix and k-gram hashes,
one probe of each k-gram in the target's anchor table, and the passes over the donor's tokens
that follow (measured up to ~38 ns per token on a 100,000-token donor of one repeated token)."""

COMPARE_UNITS_PER_TOKEN = 1
"""Units per token pair of a vectorized diagonal comparison."""

POSTING_UNITS = 2
"""Units per posting the index may read for one query key."""

ANCHOR_PAIR_UNITS = 150
"""Units per (target anchor, donor position) pair an alignment expands and sorts, and per donor
position it probes in a bucket of several target anchors (the two are capped alike)."""


@dataclass(frozen=True, slots=True)
class AlignCharge:
    """What :meth:`LookupBudget.align_limits` charged for one alignment: at most ``pairs``
    anchor pairs and ``diagonals`` diagonals of ``per_diagonal`` units each."""

    pairs: int
    diagonals: int
    per_diagonal: int


class LookupBudget:
    """Remaining work of one lookup. Owned by the provider's ``_decide``; not thread-safe."""

    def __init__(self, budget_ms: float) -> None:
        self.total = int(budget_ms * WORK_UNITS_PER_MS)
        self.remaining = self.total

    def charge(self, units: int) -> bool:
        """Spend ``units`` if they fit (True); otherwise spend nothing and return False."""
        if units > self.remaining:
            return False
        self.remaining -= units
        return True

    def region_cost(self, region_tokens: int) -> int:
        """Chunking, anchoring and prefix-hashing a target region of ``region_tokens``."""
        return REGION_UNITS_PER_TOKEN * region_tokens

    @staticmethod
    def candidates_cost(query_keys: int, postings_per_key: int) -> int:
        """Reading at most ``postings_per_key`` postings for each of ``query_keys`` keys."""
        return POSTING_UNITS * query_keys * postings_per_key

    def align_limits(
        self, target_tokens: int, donor_tokens: int, max_pairs: int, max_diagonals: int
    ) -> AlignCharge | None:
        """The anchor pairs and diagonals an alignment of a ``target_tokens`` region with a
        ``donor_tokens`` donor may use (at most ``max_pairs`` and ``max_diagonals``), charged:
        the donor's k-grams first, then half of what is left for anchor pairs and the rest for
        diagonals. None (nothing charged) when not even one pair and one diagonal fit."""
        fixed = DONOR_UNITS_PER_TOKEN * donor_tokens
        per_diagonal = COMPARE_UNITS_PER_TOKEN * max(1, min(target_tokens, donor_tokens))
        left = self.remaining - fixed
        if left < ANCHOR_PAIR_UNITS + per_diagonal:
            return None
        pairs = min(max_pairs, max(1, (left // 2) // ANCHOR_PAIR_UNITS))
        left -= pairs * ANCHOR_PAIR_UNITS
        diagonals = min(max_diagonals, left // per_diagonal)
        if diagonals < 1:
            return None
        self.remaining -= fixed + pairs * ANCHOR_PAIR_UNITS + diagonals * per_diagonal
        return AlignCharge(pairs, diagonals, per_diagonal)

    def refund_alignment(self, charge: AlignCharge, pair_work: int, diagonals: int) -> None:
        """Give back the part of ``charge`` an alignment did not use: it spent ``pair_work``
        pair units and compared ``diagonals`` diagonals (each counted at most up to what was
        charged, so a refund never exceeds the charge)."""
        unused_pairs = charge.pairs - min(max(pair_work, 0), charge.pairs)
        unused_diagonals = charge.diagonals - min(max(diagonals, 0), charge.diagonals)
        self.remaining += unused_pairs * ANCHOR_PAIR_UNITS + unused_diagonals * charge.per_diagonal

    def align(
        self, region: np.ndarray, donor: np.ndarray, anchors: Anchors, min_length: int
    ) -> tuple[Span, ...] | None:
        """Align ``region`` (whose ``anchors`` are given) with ``donor``, spans of at least
        ``min_length``, within the limits the remaining budget affords (charged up front, the
        unused part refunded after), or None (nothing charged) when not even one diagonal
        fits."""
        default = AlignLimits()
        charge = self.align_limits(
            int(region.size),
            int(donor.size),
            default.max_anchor_pairs or 1,
            default.max_diagonals or 1,
        )
        if charge is None:
            return None
        found = measured_align(
            region,
            donor,
            min_length=min_length,
            target_anchors=anchors,
            limits=AlignLimits(
                max_anchor_pairs=charge.pairs,
                max_diagonals=charge.diagonals,
                max_shared_probes=charge.pairs,
            ),
        )
        self.refund_alignment(charge, found.pair_work, found.diagonals)
        return found.spans
