"""Donor-aware data-parallel dispatch: send a request to the rank that holds its donor.

With ``--dp-size N`` each rank (scheduler) has its own KV cache, so a semantic donor helps only a
request dispatched to the donor's rank. :class:`DonorRouter` is the engine-agnostic half of the
fix: it remembers what was dispatched where (a :class:`~semblend_sglang.index.TokenIndex` with the
provider's chunking and namespaces, bounded in bytes) and proposes the rank whose remembered
request covers most of a new one, unless that rank is loaded more than
``dispatch_load_margin`` tokens above the least-loaded rank. It proposes; the engine's own method
decides whenever it returns no rank. The SGLang controller hook that calls it lives in
``semblend_sglang.patches.sglang.dp_dispatch``.

Staleness rule (no eviction reports from the ranks): each rank has a token clock, the prompt
tokens dispatched to it so far. A rank's KV pool holds ``capacity`` tokens and its radix cache
evicts least recently used first, so an entry whose rank has since been sent more than
``dispatch_expire_ratio x capacity`` tokens has most likely been evicted: it is dropped when a
probe meets it. Dispatched tokens over-count allocations (exact hits allocate nothing), so at the
default ratio 1.0 an entry expires no later than the rank's own LRU would evict an untouched
donor, and a wrong belief costs one miss (the rank's provider declines ``no_donor``), never
correctness.

Deterministic: decisions depend only on the sequence of calls (no clock, no randomness).
Not thread-safe beyond the index's own lock: one caller (the controller's event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .chunking import Chunks, as_token_array, chunk_tokens
from .config import Config
from .index import TokenIndex, salted_keys
from .namespace import Namespace
from .provider import chunk_params_for

ENTRY_OVERHEAD_BYTES = 512
"""Bytes charged per remembered request besides its postings: the index's record, sketch and
dict slots, and this router's own entry (measured with ``sys.getsizeof``; see tests)."""
POSTING_BYTES = 24
"""Bytes charged per distinct chunk key: 12 in the index's posting run, plus 12 more because a
forgotten donor's postings stay until the index compacts (at most as many dead as live)."""
FIXED_BYTES = 256 * 1024
"""Bytes reserved for the index's per-id arrays (alive mask, probe scratch), which grow with the
ids issued before a renumbering (at most 4 x max(donors, 4096))."""
MAX_CANDIDATES = 8
"""Remembered requests a probe considers (best first); several may sit on one rank."""


class Reason:
    """Why :meth:`DonorRouter.choose` proposed a rank or none."""

    DONOR = "donor"
    """A remembered request on that rank covers the most of the new one."""
    NO_DONOR = "no_donor"
    """Nothing remembered shares enough tokens (``min_candidate_tokens``)."""
    OVERLOADED = "overloaded"
    """Every rank holding a donor is loaded beyond the margin: the engine's method decides."""
    SHORT = "short"
    """Fewer tokens than ``min_span_tokens``: never remembered, never routed."""
    DISABLED = "disabled"
    """``enabled`` or ``dispatch_enabled`` is off."""


@dataclass(frozen=True, slots=True)
class Route:
    """What :meth:`DonorRouter.choose` proposes: ``rank`` (None: let the engine's own method
    decide), the ``reason``, and the query tokens in chunks shared with the chosen donor."""

    rank: int | None
    reason: str
    shared_tokens: int = 0
    chunks: Chunks | None = None


class _Entry:
    __slots__ = ("clock", "n_bytes", "rank")

    def __init__(self, rank: int, n_bytes: int, clock: int) -> None:
        self.rank = rank
        self.n_bytes = n_bytes
        self.clock = clock


class DonorRouter:
    """Remembers dispatched requests per rank and proposes the rank holding a new one's donor.

    ``n_ranks``: data-parallel ranks (ids ``0..n_ranks-1``). ``rank_capacity_tokens``: each
    rank's KV pool size in tokens (one int for all ranks), used by the expiry rule; None
    disables expiry. Callers: an engine's dispatch hook, once per request, :meth:`choose`
    then :meth:`record` with the rank the request actually went to (whoever chose it). Neither
    calls into the engine; both may raise on bad input (the hook fails open).
    """

    def __init__(
        self,
        config: Config,
        n_ranks: int,
        rank_capacity_tokens: int | Sequence[int] | None = None,
    ) -> None:
        if n_ranks < 1:
            raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
        self.config = config
        self.n_ranks = n_ranks
        self.max_bytes = int(config.dispatch_index_bytes)
        self.margin = float(config.dispatch_load_margin)
        if rank_capacity_tokens is None:
            self._expire_after: list[float] | None = None
        else:
            caps = (
                [int(rank_capacity_tokens)] * n_ranks
                if isinstance(rank_capacity_tokens, int)
                else [int(c) for c in rank_capacity_tokens]
            )
            if len(caps) != n_ranks:
                raise ValueError(f"need {n_ranks} capacities, got {len(caps)}")
            self._expire_after = [config.dispatch_expire_ratio * c for c in caps]
        self.index = TokenIndex(
            chunk_params_for(config),
            max_donors=max(1, self.max_bytes // ENTRY_OVERHEAD_BYTES),
            keep_tokens=False,
        )
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU, oldest first
        self._next_handle = 0
        self._bytes = FIXED_BYTES
        self.clock = [0] * n_ranks
        self.counts: dict[str, int] = {}

    # ----------------------------------------------------------------- decisions
    def choose(
        self,
        namespace: Namespace,
        token_ids: Sequence[int] | np.ndarray,
        loads: Sequence[float],
        active: Sequence[int] | None = None,
    ) -> Route:
        """Propose a rank for a request (``token_ids`` in ``namespace``).

        ``loads``: each rank's load in tokens as the engine sees it (queued plus in use);
        ``active``: ranks that may take requests (None: all). Goes through remembered requests
        best first (most shared tokens, then sketch similarity, then newest) and proposes the
        first whose rank is active and loaded at most ``dispatch_load_margin`` above the least
        loaded active rank. Never proposes a rank outside ``active`` and never matches across
        namespaces. Changes nothing but the expiry of stale entries it meets.
        """
        config = self.config
        if not (config.enabled and config.dispatch_enabled):
            return self._count(Route(None, Reason.DISABLED))
        tokens = as_token_array(token_ids)
        if tokens.size < config.min_span_tokens:
            return self._count(Route(None, Reason.SHORT))
        chunks = chunk_tokens(tokens, self.index.params)
        found = self.index.candidates(
            namespace,
            chunks,
            limit=MAX_CANDIDATES,
            min_shared_tokens=config.min_candidate_tokens,
        )
        allowed = range(self.n_ranks) if active is None else active
        allowed_set = set(allowed)
        floor = min((float(loads[r]) for r in allowed), default=0.0)
        overloaded = False
        for cand in found:
            entry = self._entries.get(int(cand.handle))  # type: ignore[call-overload]
            if entry is None:
                continue
            if self._expired(entry):
                self._drop(int(cand.handle))  # type: ignore[call-overload]
                self._bump("expired")
                continue
            if entry.rank not in allowed_set:
                continue
            if float(loads[entry.rank]) > floor + self.margin:
                overloaded = True
                continue
            return self._count(Route(entry.rank, Reason.DONOR, cand.shared_tokens, chunks))
        reason = Reason.OVERLOADED if overloaded else Reason.NO_DONOR
        return self._count(Route(None, reason, 0, chunks))

    def record(
        self,
        namespace: Namespace,
        token_ids: Sequence[int] | np.ndarray,
        rank: int,
        route: Route | None = None,
    ) -> None:
        """Remember that ``token_ids`` (``namespace``) went to ``rank``: advances the rank's
        token clock and makes the request a donor on that rank (requests shorter than
        ``min_span_tokens`` advance the clock only). ``route``: this request's :meth:`choose`
        result, whose chunks are reused. Evicts least recently recorded entries to stay within
        ``dispatch_index_bytes``."""
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank {rank} outside 0..{self.n_ranks - 1}")
        tokens = as_token_array(token_ids)
        self.clock[rank] += int(tokens.size)
        config = self.config
        if not (config.enabled and config.dispatch_enabled):
            return
        if tokens.size < config.min_span_tokens:
            return
        chunks = route.chunks if route is not None and route.chunks is not None else None
        if chunks is None:
            chunks = chunk_tokens(tokens, self.index.params)
        n_keys = int(np.unique(salted_keys(chunks, namespace)).size)
        n_bytes = ENTRY_OVERHEAD_BYTES + POSTING_BYTES * n_keys
        if FIXED_BYTES + n_bytes > self.max_bytes:
            self._bump("too_large")
            return
        handle = self._next_handle
        self._next_handle += 1
        while self._entries and self._bytes + n_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self._bump("evicted")
        for gone in self.index.register(namespace, handle, tokens):
            self._drop(int(gone), in_index=False)  # type: ignore[call-overload]
        self._entries[handle] = _Entry(rank, n_bytes, self.clock[rank])
        self._bytes += n_bytes

    def forget_rank(self, rank: int) -> None:
        """Drop every entry on ``rank`` (its cache was flushed or the rank went away)."""
        for handle in [h for h, e in self._entries.items() if e.rank == rank]:
            self._drop(handle)

    # ----------------------------------------------------------------- accounting
    def charged_bytes(self) -> int:
        """Bytes charged against ``dispatch_index_bytes`` (never above it)."""
        return self._bytes

    def nbytes(self) -> int:
        """Measured bytes: the index's own estimate plus this router's entries."""
        import sys

        own = sys.getsizeof(self._entries) + sum(
            sys.getsizeof(e) + 2 * sys.getsizeof(h) for h, e in self._entries.items()
        )
        return self.index.nbytes() + own

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        """Counters: decisions by reason, expired/evicted entries, entries, charged bytes."""
        out = dict(self.counts)
        out["entries"] = len(self._entries)
        out["charged_bytes"] = self._bytes
        out["max_bytes"] = self.max_bytes
        return out

    # ----------------------------------------------------------------- internals
    def _expired(self, entry: _Entry) -> bool:
        limits = self._expire_after
        return limits is not None and self.clock[entry.rank] - entry.clock > limits[entry.rank]

    def _drop(self, handle: int, *, in_index: bool = True) -> None:
        entry = self._entries.pop(handle, None)
        if entry is not None:
            self._bytes -= entry.n_bytes
        if in_index:
            self.index.forget(handle)

    def _bump(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _count(self, route: Route) -> Route:
        self._bump(route.reason)
        return route
