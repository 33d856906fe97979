"""Which donors lost their KV when SGLang's tree freed device slots: the eviction hook.

SGLang's tree evicts leaves first, so a donor's KV is gone once the slot of its first prompt token
(its *head*, shared by every donor with the same first tokens) leaves the device.
:class:`~.donor_kv.DonorKV` watches each donor's head slot from its registration; the adapter's
wrapper of the tree's slot release (``UnifiedRadixCache._free_values``, through which every
eviction step frees device values) reports freed slots here, and after the eviction DonorKV
forgets those donors (not held ones; with a host tier none: a freed slot may be a demotion), so
the index never offers them to a lookup.

Owns no slot and imports nothing from sglang. Called by :class:`~.donor_kv.DonorKV` only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class DonorHeads:
    """The head slot of each watched donor of one tree cache, and the donors whose head slot was
    freed since :meth:`take_freed` last ran.

    ``bound``: watched donors above which :meth:`watch` first forgets those ``is_donor`` says
    the index no longer holds (so that the map never outgrows the index)."""

    def __init__(self, bound: int, is_donor: Callable[[Hashable], bool]) -> None:
        self._bound = max(1, int(bound))
        self._is_donor = is_donor
        self._watched: dict[Hashable, int] = {}
        self._by_slot: dict[int, set[Hashable]] = {}
        self._slots: torch.Tensor | None = None  # the watched slots, rebuilt when stale
        self._freed: dict[Hashable, None] = {}  # insertion-ordered set

    def __len__(self) -> int:
        return len(self._watched)

    def __contains__(self, handle: object) -> bool:
        return handle in self._watched

    def watch(self, handle: Hashable, slot: int) -> None:
        """Watch donor ``handle``, whose first prompt token's KV is at tree slot ``slot``."""
        self.unwatch(handle)
        if len(self._watched) >= self._bound:
            for gone in [h for h in self._watched if not self._is_donor(h)]:
                self.unwatch(gone)
        slot = int(slot)
        self._watched[handle] = slot
        self._by_slot.setdefault(slot, set()).add(handle)
        self._slots = None

    def unwatch(self, handle: Hashable) -> None:
        """Stop watching ``handle`` (forgotten, or no longer a donor); a no-op when unwatched."""
        self._freed.pop(handle, None)
        slot = self._watched.pop(handle, None)
        if slot is None:
            return
        owners = self._by_slot.get(slot)
        if owners is not None:
            owners.discard(handle)
            if not owners:
                del self._by_slot[slot]
        self._slots = None

    def freed(self, slots: torch.Tensor) -> None:
        """SGLang freed device ``slots`` (a 1-D integer tensor): the donors whose head was among
        them are no longer watched and wait in :meth:`take_freed`."""
        if not self._by_slot or slots.numel() == 0:
            return
        if self._slots is None:
            self._slots = torch.tensor(list(self._by_slot), dtype=torch.int64)
        flat = slots.reshape(-1).to(device="cpu", dtype=torch.int64)
        hit = flat[torch.isin(flat, self._slots)]
        for slot in hit.tolist():
            for handle in list(self._by_slot.get(slot, ())):
                self.unwatch(handle)
                self._freed[handle] = None
        if hit.numel():
            self._slots = None

    def take_freed(self) -> list[Hashable]:
        """The donors whose head slot was freed, once each."""
        out = list(self._freed)
        self._freed.clear()
        return out

    def clear(self) -> None:
        """Forget everything (the cache was reset)."""
        self._watched.clear()
        self._by_slot.clear()
        self._freed.clear()
        self._slots = None
