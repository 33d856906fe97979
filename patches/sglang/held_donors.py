"""Donor KV kept outside SGLang's tree: the prompt tail of a finished request that reused KV.

Such a request publishes only its exact head (the prompt before its publish cap); the rest of its
prompt KV is approximate and never enters the exact cache. Freed at release, it would take the
passages the request computed itself with it, so a later request could find them in no donor.
:class:`HeldDonorStore` keeps those slots instead, as donor KV for the sparse extend only.

Ownership: a slot in the store is owned by the store alone, from :meth:`HeldDonorStore.keep`
until :meth:`~HeldDonorStore.evict`, :meth:`~HeldDonorStore.drop` or
:meth:`~HeldDonorStore.clear` frees it. The adapter counts the store as evictable memory and
evicts it before SGLang's tree, so SGLang's admission budget and idle checks see every slot.
:class:`HeldDonors` is the policy (what to keep at a row's release, what to evict first) and the
counters, one per scheduler process. Nothing here imports sglang; the cache's allocator and
``req_to_token`` rows are read through duck typing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from semblend_sglang.namespace import Namespace

from .donor_heads import DonorHeads

if TYPE_CHECKING:
    from .runtime import SemblendRuntime

CACHE_ATTR = "_semblend_cache"
"""Attribute of a tree-cache instance that holds its :class:`CacheReuse`."""


@dataclass
class CacheReuse:
    """semblend's per-cache state: the held donors (``held``) and the watched donor heads
    (``heads``, :mod:`.donor_heads`), each created on first use."""

    held: HeldDonorStore | None = None
    heads: DonorHeads | None = None


def cache_reuse(cache: Any) -> CacheReuse:
    """The :class:`CacheReuse` of tree cache ``cache`` (created on first use)."""
    found: CacheReuse | None = getattr(cache, CACHE_ATTR, None)
    if found is None:
        found = CacheReuse()
        setattr(cache, CACHE_ATTR, found)
    return found


def held_of(cache: Any) -> HeldDonorStore | None:
    """The held-donor store of ``cache``, or None when it never held one."""
    found: CacheReuse | None = getattr(cache, CACHE_ATTR, None)
    return None if found is None else found.held


@dataclass
class HeldDonorCounts:
    """Counters of the held donors (process lifetime; ``tokens`` is the current size), written by
    :class:`HeldDonors` only.

    ``kept``: finished requests whose unpublished prompt KV was kept; ``matched``: donor matches
    that used held slots; ``evicted``: entries freed for memory; ``dropped``: entries freed
    because their donor was dropped or the cache was reset."""

    kept: int = 0
    matched: int = 0
    evicted: int = 0
    dropped: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class HeldDonor:
    """Donor ``handle``'s KV slots for its prompt positions ``[held_from, held_from + len(slots))``
    (int64, on the pool's device); positions before ``held_from`` are in the exact tree."""

    handle: Hashable
    held_from: int
    slots: torch.Tensor

    @property
    def held_to(self) -> int:
        """One past the last held position."""
        return self.held_from + int(self.slots.numel())


class HeldDonorStore:
    """The held donors of one tree cache, least recently used first.

    Called by the adapter's hooks only (scheduler thread). ``free(slots)`` gives slots back to
    the cache's allocator. Never frees a slot twice: an entry leaves the store before its slots
    are freed, and each entry is freed at most once.
    """

    def __init__(self, free: Callable[[torch.Tensor], None]) -> None:
        self._free = free
        self._entries: OrderedDict[Hashable, HeldDonor] = OrderedDict()
        self._tokens = 0

    @property
    def held_tokens(self) -> int:
        """Slots the store owns."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, handle: Hashable) -> bool:
        return handle in self._entries

    def handles(self) -> list[Hashable]:
        """Held donor handles, least recently used first."""
        return list(self._entries)

    def all_slots(self) -> torch.Tensor:
        """Every held slot (int64, CPU), for accounting checks."""
        if not self._entries:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([e.slots.cpu() for e in self._entries.values()])

    def keep(self, handle: Hashable, held_from: int, slots: torch.Tensor) -> None:
        """Take ownership of ``slots`` (the caller's, now the store's) as donor ``handle``'s KV
        from position ``held_from`` on. A handle already held is replaced and its old slots
        freed."""
        self.drop(handle)
        entry = HeldDonor(handle, int(held_from), slots.to(torch.int64))
        self._entries[handle] = entry
        self._tokens += int(entry.slots.numel())

    def get(self, handle: Hashable) -> HeldDonor | None:
        """The held entry of ``handle`` (marked most recently used), or None."""
        entry = self._entries.get(handle)
        if entry is not None:
            self._entries.move_to_end(handle)
        return entry

    def drop(self, handle: Hashable) -> bool:
        """Free ``handle``'s slots (its donor is gone); False when it was not held."""
        entry = self._entries.pop(handle, None)
        if entry is None:
            return False
        self._tokens -= int(entry.slots.numel())
        self._free(entry.slots)
        return True

    def drop_all(self, handles: Iterable[Hashable]) -> None:
        """:meth:`drop` each of ``handles``."""
        for handle in handles:
            self.drop(handle)

    def evict(self, num_tokens: int) -> tuple[int, list[Hashable]]:
        """Free least recently used entries until ``num_tokens`` slots were freed or the store is
        empty: (slots freed, handles evicted). The caller forgets the evicted donors."""
        freed = 0
        gone: list[Hashable] = []
        while freed < num_tokens and self._entries:
            handle = next(iter(self._entries))
            entry = self._entries[handle]
            self.drop(handle)
            freed += int(entry.slots.numel())
            gone.append(handle)
        return freed, gone

    def clear(self) -> list[Hashable]:
        """Free every entry (the cache is being reset); returns the handles that were held."""
        gone = list(self._entries)
        self.drop_all(gone)
        return gone


@dataclass(frozen=True)
class PendingKeep:
    """A finished request that reused KV, between its last checkpoint and its row's release:
    what its held donor entry will be registered as (the adapter's, until ``free_kv_row``)."""

    kv: Any
    rid: str
    namespace: Namespace
    tokens: list[int]


def held_store_tokens(cache: Any) -> int:
    """Slots held as donor KV outside ``cache``'s tree (0 when it has no store)."""
    store = held_of(cache)
    return 0 if store is None else store.held_tokens


@dataclass
class HeldDonors:
    """What the hooks of one scheduler process keep as held donors, and when they free them.

    ``runtime`` is the donor registry (register, forget); ``counts`` are this policy's counters
    (``held_donors`` in the runtime's snapshot). Called by the adapter's hooks only (scheduler
    thread); every method may raise, and then frees what it took (the hook guard makes the
    error a counted fallback)."""

    runtime: SemblendRuntime
    counts: HeldDonorCounts
    pending: dict[int, PendingKeep] = field(default_factory=dict)
    """Finished requests to keep as held donors, by ``id(req.kv)``, from their last checkpoint
    to their row's release (:meth:`take_pending`)."""

    def mark(self, pending: PendingKeep) -> None:
        """Keep ``pending``'s unpublished prompt KV when its row is released."""
        self.pending[id(pending.kv)] = pending

    def take_pending(self, kv: Any) -> PendingKeep | None:
        """The pending keep of row handle ``kv`` (removed), or None."""
        pending = self.pending.pop(id(kv), None)
        return pending if pending is not None and pending.kv is kv else None

    def split_release(
        self, cache: Any, pending: PendingKeep, ranges: list[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], torch.Tensor, int] | None:
        """The release of a row marked with ``pending`` frees ``ranges``: (what is still to be
        freed, the prompt slots to keep, their first position), or None to free everything
        (nothing of the prompt is unpublished, the row is not the expected one, or no whole
        page of it is). With pages the store keeps whole pages only: from ``lo`` (a page
        boundary) to the last page boundary inside the prompt; the page the prompt ends in
        also holds output tokens and is freed with them, so every page has one owner."""
        page = int(cache.page_size)
        if len(ranges) != 1:
            return None
        lo, hi = int(ranges[0][0]), int(ranges[0][1])
        prompt_len = len(pending.tokens)
        if not lo < prompt_len <= hi:
            return None
        kept_end = prompt_len // page * page
        if lo % page or kept_end <= lo:
            return None
        row = cache.req_to_token_pool.req_to_token[pending.kv.req_pool_idx]
        slots = row[lo:kept_end].to(torch.int64).clone()
        return ([(kept_end, hi)] if kept_end < hi else []), slots, lo

    def keep(self, cache: Any, pending: PendingKeep, slots: torch.Tensor, held_from: int) -> None:
        """Hold ``slots`` (prompt positions from ``held_from`` on, no longer in the request's
        row) as donor KV of ``pending``'s prompt up to the last held position. On any failure
        before the store owns them the slots are freed."""
        runtime = self.runtime
        store = self.store(cache)
        try:
            held_to = held_from + int(slots.numel())  # the prompt's KV ends here
            dropped = runtime.register_donor(
                pending.namespace, pending.rid, pending.tokens[:held_to], extend=True
            )
            handle = runtime.donor_handle(pending.rid)
            if handle is None or not runtime.is_donor(handle):
                cache.token_to_kv_pool_allocator.free(slots)
                return
        except BaseException:
            cache.token_to_kv_pool_allocator.free(slots)
            raise
        store.keep(handle, held_from, slots)
        gone = [h for h in dropped if h in store]
        store.drop_all(gone)
        self.counts.kept += 1
        self.counts.dropped += len(gone)
        self.counts.tokens = store.held_tokens

    def store(self, cache: Any) -> HeldDonorStore:
        """The store of ``cache`` (created on first use; it frees into the cache's allocator)."""
        state = cache_reuse(cache)
        if state.held is None:
            state.held = HeldDonorStore(cache.token_to_kv_pool_allocator.free)
        return state.held

    def evict(self, cache: Any, num_tokens: int) -> int:
        """Free held donors before SGLang's tree evicts anything: those whose donor the provider
        dropped first, then least recently used ones until ``num_tokens`` slots were freed
        (their donors forgotten). Returns the slots freed."""
        store = held_of(cache)
        if store is None or not len(store) or num_tokens <= 0:
            return 0
        runtime = self.runtime
        before = store.held_tokens
        orphans = [h for h in store.handles() if not runtime.is_donor(h)]
        store.drop_all(orphans)
        freed = before - store.held_tokens
        more, gone = store.evict(num_tokens - freed)
        for handle in gone:
            runtime.forget_donor(handle)
        self.counts.dropped += len(orphans)
        self.counts.evicted += len(gone)
        self.counts.tokens = store.held_tokens
        return freed + more

    def drop(self, cache: Any, handle: Hashable) -> None:
        """Donor ``handle``'s KV is gone: free what the store held of it."""
        store = held_of(cache)
        if store is not None and store.drop(handle):
            self.counts.dropped += 1
            self.counts.tokens = store.held_tokens

    def clear(self, cache: Any) -> None:
        """The cache is being reset: free every held donor (the provider forgets them next)."""
        store = held_of(cache)
        if store is not None:
            self.counts.dropped += len(store.clear())
            self.counts.tokens = 0

    def matched(self) -> None:
        """A donor match used held slots."""
        self.counts.matched += 1
