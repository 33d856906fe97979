"""The enumerated settings (``mode``, ``recompute_strategy``), torch-free.

:class:`semblend_sglang.config.Config` holds a member of each (its values are the choices); the
selection code that spends the recompute budget is :mod:`semblend_sglang.recompute`, which
imports torch. Keeping the names here lets ``semblend_sglang.config`` and the
``semblend-sglang`` command load without torch.
"""

from __future__ import annotations

import enum


class ReuseMode(enum.StrEnum):
    """What semblend does with a donor it finds (the ``mode`` setting)."""

    DISCOVERY_ONLY = "discovery_only"
    EXACT_SPANS = "exact_spans"
    SUBSTITUTE = "substitute"


class RecomputeStrategy(enum.StrEnum):
    """How the recompute budget is spent (the ``recompute_strategy`` setting)."""

    HEADS = "heads"
    DEVIATION = "deviation"
    QUERY = "query"

    @property
    def uses_check_layer(self) -> bool:
        """True when the selection is made inside the forward, at the check layer."""
        return self is not RecomputeStrategy.HEADS
