"""Donor-aware data-parallel dispatch: send a request to the rank that holds its donor.

With ``--dp-size N`` each rank (scheduler) has its own KV cache, so a semantic donor helps only a
request dispatched to the donor's rank. :class:`DonorRouter` is the engine-agnostic half of the
fix: it remembers what was dispatched where and proposes the rank whose remembered request
covers most of a new one, unless that rank is loaded more than
``dispatch_load_margin`` tokens above the least-loaded rank. It proposes; the engine's own method
decides whenever it returns no rank. The SGLang controller hook that calls it lives in
``semblend_sglang.patches.sglang.engine.dp_dispatch``.

Staleness rule (no eviction reports from the ranks): each rank has a token clock, the prompt
tokens dispatched to it so far. A rank's KV pool holds ``capacity`` tokens and its radix cache
evicts least recently used first, so an entry whose rank has since been sent more than
``dispatch_expire_ratio x capacity`` tokens has most likely been evicted: it is dropped when a
probe meets it. Dispatched tokens over-count allocations (exact hits allocate nothing), so at the
default ratio 1.0 an entry expires no later than the rank's own LRU would evict an untouched
donor, and a wrong belief costs one miss (the rank's provider declines ``no_donor``), never
correctness.

What it remembers: each request's content-defined chunks (the provider's chunk hashing and
namespace-salted keys, :func:`~semblend_sglang.chunk_keys.salted_keys`, so requests of different
namespaces never match), cut coarser than the provider's (``dispatch_chunk_avg_tokens``, default
64 against 16: a rank needs evidence that it holds a donor, not the spans to align), in a Python
dict from chunk key to the newest :data:`MAX_POSTINGS_PER_KEY` requests posting it. A decision
is one pass over the request's chunks: its cost does not grow with what is remembered, so the
controller's per-request cost has no tail from index maintenance (the provider's sorted posting
runs are merged and compacted now and then, which a dispatcher on the request path cannot
afford). Bounded in bytes (``dispatch_index_bytes``), least recently recorded first out.

Deterministic: decisions depend only on the sequence of calls (no clock, no randomness, no
Python string hashing). Not thread-safe: one caller (the controller's event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .chunk_keys import salted_keys
from .chunking import ChunkParams, Chunks, as_token_array, chunk_tokens
from .config import Config
from .namespace import Namespace

ENTRY_OVERHEAD_BYTES = 512
"""Bytes charged per remembered request besides its keys: its entry object, its slot in the
entry dict, its key array's header and its handle (measured with ``sys.getsizeof``; see tests)."""
POSTING_BYTES = 192
"""Bytes charged per distinct chunk key of a remembered request, an upper bound of what one
costs: the key in the entry's array (8), the handle's slot in the key's posting list (8) and,
when the key is new, a Python int (36), a posting list (64 with one slot of spare capacity
at most) and a slot of the posting dict (up to 72 just after the dict grows)."""
FIXED_BYTES = 256 * 1024
"""Bytes reserved for the containers' empty-slot growth and the router's fixed state."""
MAX_CANDIDATES = 8
"""Remembered requests a probe considers (best first); several may sit on one rank."""
MAX_POSTINGS_PER_KEY = 8
"""Remembered requests kept per chunk key, the newest: a chunk shared by thousands of requests
(a system prompt) then costs a bounded amount per probe, and the requests it still points to
are the most recently dispatched, the likeliest still resident."""


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
    tokens: np.ndarray | None = None
    """The request's token ids as checked int64 (``as_token_array``), for :meth:`record`."""
    keys: np.ndarray | None = None
    """Its chunks' namespace-salted keys (:func:`~semblend_sglang.chunk_keys.salted_keys`)."""
    donor: int | None = None
    """The handle (:meth:`DonorRouter.record`'s return) of the remembered request chosen."""


class _Entry:
    __slots__ = ("clock", "keys", "n_bytes", "namespace", "rank")

    def __init__(
        self, rank: int, n_bytes: int, clock: int, namespace: Namespace, keys: np.ndarray
    ) -> None:
        self.rank = rank
        self.n_bytes = n_bytes
        self.clock = clock
        self.namespace = namespace
        self.keys = keys  # distinct salted chunk keys (uint64)


class DonorRouter:
    """Remembers dispatched requests per rank and proposes the rank holding a new one's donor.

    ``n_ranks``: data-parallel ranks (ids ``0..n_ranks-1``). ``rank_capacity_tokens``: each
    rank's KV pool size in tokens (one int for all ranks), used by the expiry rule; None
    disables expiry. Callers: an engine's dispatch hook, once per request, :meth:`choose`
    then :meth:`record` with the rank the request actually went to (whoever chose it). Neither
    calls into the engine; both may raise on bad input (the hook fails open). Each call costs
    O(chunks of the request x :data:`MAX_POSTINGS_PER_KEY`), never O(remembered requests).
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
        self.params = ChunkParams.for_avg(config.dispatch_chunk_avg_tokens)
        """Chunking of the router's index (``dispatch_chunk_avg_tokens``)."""
        self._postings: dict[int, list[int]] = {}  # salted key -> handles, oldest first
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
        ``active``: ranks that may take requests (None: all). Goes through the remembered
        requests sharing at least ``min_candidate_tokens`` of its tokens (in shared chunks),
        best first (most shared tokens, then newest), at most :data:`MAX_CANDIDATES`, and
        proposes the first whose rank is active and loaded at most ``dispatch_load_margin``
        above the least loaded active rank. Never proposes a rank outside ``active`` and never
        matches across namespaces. Changes nothing but the expiry of stale entries it meets.
        """
        config = self.config
        if not (config.enabled and config.dispatch_enabled):
            return self._count(Route(None, Reason.DISABLED))
        tokens = as_token_array(token_ids)
        if tokens.size < config.min_span_tokens:
            return self._count(Route(None, Reason.SHORT, tokens=tokens))
        chunks = chunk_tokens(tokens, self.params)
        keys = salted_keys(chunks, namespace)
        found = self._candidates(namespace, keys, chunks, config.min_candidate_tokens)
        allowed = range(self.n_ranks) if active is None else active
        allowed_set = set(allowed)
        floor = min((float(loads[r]) for r in allowed), default=0.0)
        overloaded = False
        for shared, handle in found:
            entry = self._entries[handle]
            if self._expired(entry):
                self._drop(handle)
                self._bump("expired")
                continue
            if entry.rank not in allowed_set:
                continue
            if float(loads[entry.rank]) > floor + self.margin:
                overloaded = True
                continue
            route = Route(entry.rank, Reason.DONOR, shared, chunks, tokens, keys, handle)
            return self._count(route)
        reason = Reason.OVERLOADED if overloaded else Reason.NO_DONOR
        return self._count(Route(None, reason, 0, chunks, tokens, keys))

    def record(
        self,
        namespace: Namespace,
        token_ids: Sequence[int] | np.ndarray,
        rank: int,
        route: Route | None = None,
    ) -> int | None:
        """Remember that ``token_ids`` (``namespace``) went to ``rank``: advances the rank's
        token clock and makes the request a donor on that rank (requests shorter than
        ``min_span_tokens`` advance the clock only). ``route``: this request's :meth:`choose`
        result in the same namespace, whose tokens, chunks and keys are reused (it must be
        that; only its length is checked). Evicts least recently recorded entries to stay
        within ``dispatch_index_bytes``. Returns the remembered request's handle (None: not
        remembered)."""
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank {rank} outside 0..{self.n_ranks - 1}")
        if route is not None and route.tokens is not None and len(token_ids) == route.tokens.size:
            tokens = route.tokens  # converted and checked once, in choose
        else:
            route = None
            tokens = as_token_array(token_ids)
        self.clock[rank] += int(tokens.size)
        config = self.config
        if not (config.enabled and config.dispatch_enabled):
            return None
        if tokens.size < config.min_span_tokens:
            return None
        keys = route.keys if route is not None else None
        if keys is None:
            keys = salted_keys(chunk_tokens(tokens, self.params), namespace)
        distinct = list(dict.fromkeys(keys.tolist()))  # first occurrences, in order
        n_bytes = ENTRY_OVERHEAD_BYTES + POSTING_BYTES * len(distinct)
        if FIXED_BYTES + n_bytes > self.max_bytes:
            self._bump("too_large")
            return None
        while self._entries and self._bytes + n_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self._bump("evicted")
        handle = self._next_handle
        self._next_handle += 1
        postings = self._postings
        cap = MAX_POSTINGS_PER_KEY
        for key in distinct:
            handles = postings.get(key)
            if handles is None:
                postings[key] = [handle]
            else:
                handles.append(handle)
                if len(handles) > cap:
                    del handles[0]  # the oldest request no longer counts for this chunk
        self._entries[handle] = _Entry(
            rank, n_bytes, self.clock[rank], namespace, np.array(distinct, dtype=np.uint64)
        )
        self._bytes += n_bytes
        return handle

    def forget(self, handle: int) -> None:
        """Drop the remembered request ``handle`` (its KV is known to be gone); no-op when it
        was dropped already."""
        self._drop(handle)

    def forget_rank(self, rank: int) -> None:
        """Drop every entry on ``rank`` (its cache was flushed or the rank went away)."""
        for handle in [h for h, e in self._entries.items() if e.rank == rank]:
            self._drop(handle)

    # ----------------------------------------------------------------- accounting
    def charged_bytes(self) -> int:
        """Bytes charged against ``dispatch_index_bytes`` (never above it)."""
        return self._bytes

    def nbytes(self) -> int:
        """Measured bytes (``sys.getsizeof``) of the posting dict, its keys and lists, and the
        entries with their key arrays and handles. O(index size): for tests and reports."""
        import sys

        size = sys.getsizeof
        total = size(self._postings) + size(self._entries)
        for key, handles in self._postings.items():
            total += size(key) + size(handles)
        for handle, entry in self._entries.items():
            total += size(handle) + size(entry) + size(entry.keys)
        return total

    def __contains__(self, handle: object) -> bool:
        """True while ``handle`` (a :meth:`record` return) is remembered."""
        return handle in self._entries

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
    def _candidates(
        self, namespace: Namespace, keys: np.ndarray, chunks: Chunks, min_shared: int
    ) -> list[tuple[int, int]]:
        """(shared tokens, handle) of the entries of ``namespace`` whose chunks cover at least
        ``min_shared`` query tokens, best first (most shared, then newest), at most
        :data:`MAX_CANDIDATES`. A key occurring twice in the query counts its tokens twice, as
        the provider's index does."""
        postings = self._postings
        scores: dict[int, int] = {}
        get = scores.get
        for key, length in zip(keys.tolist(), chunks.lengths.tolist(), strict=True):
            handles = postings.get(key)
            if handles is not None:
                for handle in handles:
                    scores[handle] = get(handle, 0) + length
        if not scores:
            return []
        found = [(shared, h) for h, shared in scores.items() if shared >= min_shared]
        found.sort(reverse=True)
        entries = self._entries
        # salted keys of two namespaces coincide only by a 63-bit hash collision: checked anyway
        return [(sh, h) for sh, h in found if entries[h].namespace == namespace][:MAX_CANDIDATES]

    def _expired(self, entry: _Entry) -> bool:
        limits = self._expire_after
        return limits is not None and self.clock[entry.rank] - entry.clock > limits[entry.rank]

    def _drop(self, handle: int) -> None:
        entry = self._entries.pop(handle, None)
        if entry is None:
            return
        self._bytes -= entry.n_bytes
        postings = self._postings
        for key in entry.keys.tolist():
            handles = postings.get(key)
            if handles is not None and handle in handles:
                if len(handles) == 1:
                    del postings[key]
                else:
                    handles.remove(handle)

    def _bump(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _count(self, route: Route) -> Route:
        self._bump(route.reason)
        return route
