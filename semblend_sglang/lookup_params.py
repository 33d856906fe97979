"""What a lookup is asked, and the engine callbacks it may use (torch-free).

:class:`LookupParams` is the one argument of :meth:`SemanticProvider.lookup
<semblend_sglang.provider.SemanticProvider.lookup>`; the callback types are what an engine passes
the provider.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .namespace import Namespace

TokenSource = Callable[[Hashable], "Sequence[int] | np.ndarray | None"]
"""Returns a donor's tokens from the engine, or None when its KV is gone."""
DonorAlive = Callable[[Hashable, np.ndarray], int]
"""How many leading tokens of donor ``handle`` (given its tokens) the engine still holds KV for;
asked per candidate during a lookup, so that an evicted donor is forgotten and the next candidate
tried, and a partly evicted one is aligned over what is left."""
DonorGone = Callable[[Hashable], None]
"""Told of a candidate donor a lookup found gone (fewer than ``min_span_tokens`` tokens alive, or
none from the token source): the engine's owner of donors forgets it everywhere it keeps
something of it, the provider's index included (:meth:`SemanticProvider.forget
<semblend_sglang.provider.SemanticProvider.forget>`). May not raise."""
Detokenize = Callable[[Sequence[int]], str]
"""Turns token ids back into text (only for the embedder)."""


@dataclass(frozen=True)
class LookupParams:
    """One lookup: request ``request_id``'s prompt ``token_ids`` in ``namespace``, with the
    engine's own exact prefix hit ``exact_len``. ``request_id=None`` keeps no decision;
    ``page_size`` is the engine's KV page size (plans are page-aligned on the target side);
    ``alive`` counts a candidate donor's leading tokens whose KV the engine still holds (None:
    every indexed donor is taken as whole; the engine finds out at its copy); ``gone`` is told of
    each candidate found gone (None: the provider forgets it itself, for engines that keep
    nothing of a donor beside the provider)."""

    namespace: Namespace
    token_ids: Sequence[int] | np.ndarray
    exact_len: int
    request_id: Hashable | None = None
    page_size: int = 1
    alive: DonorAlive | None = None
    gone: DonorGone | None = None
