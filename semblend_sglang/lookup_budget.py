"""The work budget of one provider lookup, counted in operations rather than measured in time.

A lookup runs in the engine's scheduler loop, so it must stay short on any input (a 100K-token
prompt, one token repeated, a chunk shared with a thousand donors). Tensor-parallel ranks must
also decide alike (no timing in a decision), so the budget is counted, deterministically, in
work units that approximate nanoseconds on this project's reference CPU: ``lookup_budget_ms``
milliseconds are ``lookup_budget_ms * WORK_UNITS_PER_MS`` units, and each step of a lookup is
charged its worst-case cost before it runs. A lookup whose next step does not fit stops there:
with no plan yet, the request goes on cold (``lookup_budget``, counted); otherwise the plan found
so far stands.
"""

from __future__ import annotations

WORK_UNITS_PER_MS = 1_000_000
"""Work units in one millisecond of the reference CPU (one unit is about a nanosecond)."""

HASH_UNITS_PER_TOKEN = 10
"""Units per token of a rolling-hash pass (chunking the target, k-grams of a donor)."""

COMPARE_UNITS_PER_TOKEN = 1
"""Units per token pair of a vectorized diagonal comparison."""

POSTING_UNITS = 2
"""Units per posting the index may read for one query key."""


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
        return 2 * HASH_UNITS_PER_TOKEN * region_tokens

    @staticmethod
    def candidates_cost(query_keys: int, postings_per_key: int) -> int:
        """Reading at most ``postings_per_key`` postings for each of ``query_keys`` keys."""
        return POSTING_UNITS * query_keys * postings_per_key

    def diagonals_that_fit(self, target_tokens: int, donor_tokens: int, cap: int) -> int:
        """How many diagonals (at most ``cap``) an alignment of a ``target_tokens`` region with a
        ``donor_tokens`` donor may measure after paying for the donor's k-grams; 0 when not even
        one fits. Charges nothing."""
        fixed = HASH_UNITS_PER_TOKEN * donor_tokens
        per_diagonal = COMPARE_UNITS_PER_TOKEN * max(1, min(target_tokens, donor_tokens))
        if fixed + per_diagonal > self.remaining:
            return 0
        return min(cap, (self.remaining - fixed) // per_diagonal)

    @staticmethod
    def align_cost(target_tokens: int, donor_tokens: int, diagonals: int) -> int:
        """The worst case of one alignment measuring ``diagonals`` diagonals."""
        per_diagonal = COMPARE_UNITS_PER_TOKEN * max(1, min(target_tokens, donor_tokens))
        return HASH_UNITS_PER_TOKEN * donor_tokens + diagonals * per_diagonal
