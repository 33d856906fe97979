"""Donor KV kept outside SGLang's tree: the prompt tail of a finished request that reused KV.

Such a request publishes only its exact head (before its publish cap); the rest of its prompt KV
is approximate and never enters the exact cache, and freed at release it would leave the passages
the request computed itself in no donor. :class:`HeldDonorStore` keeps those slots instead, as
donor KV for the sparse extend only, owned by the store alone from :meth:`~HeldDonorStore.keep`
until it evicts, drops or clears them. The adapter counts the store as evictable and evicts it
before SGLang's tree, so SGLang's admission budget and idle checks see every slot.
:class:`~.donor_kv.DonorKV` is its policy and writes its counters. Imports no sglang module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch


@dataclass
class HeldDonorCounts:
    """Counters of the held donors (process lifetime; ``tokens`` is the current size), written by
    :class:`~.donor_kv.DonorKV` only.

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

    Called by :class:`~.donor_kv.DonorKV` only. ``free(slots)`` gives slots back to the cache's
    allocator. Never frees a slot twice: an entry leaves the store before its slots are freed.
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
