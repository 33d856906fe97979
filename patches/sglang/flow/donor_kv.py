"""The one owner of donor KV in a scheduler process (:class:`DonorKV`): which requests are
donors, what the held store (:mod:`.held_donors`) keeps of them, which head slots are watched
(:mod:`.donor_heads`), and every way a donor is forgotten: its head evicted, its KV missing at a
match, dropped by the index, the cache reset. Imports no sglang module: the tree is read through
the version's :class:`~.version_view.VersionView`; caches and rows are read by duck typing.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from semblend_sglang.config import Config
from semblend_sglang.lookup_params import DonorAlive
from semblend_sglang.namespace import Namespace
from semblend_sglang.plan import Reason
from semblend_sglang.provider import SemanticProvider

from ..request_info import eligible, namespace_for
from ..version_view import TreeMatchParams, VersionView
from .donor_heads import DonorHeads
from .held_donors import HeldDonorCounts, HeldDonorStore

CACHE_ATTR = "_semblend_cache"
"""Attribute of a tree-cache instance that holds its :class:`CacheReuse`."""


@dataclass
class CacheReuse:
    """One tree cache's held store (``held``) and watched donor heads (``heads``), if any."""

    held: HeldDonorStore | None = None
    heads: DonorHeads | None = None


def cache_reuse(cache: Any) -> CacheReuse:
    """The :class:`CacheReuse` of tree cache ``cache`` (created on first use)."""
    if not hasattr(cache, CACHE_ATTR):
        setattr(cache, CACHE_ATTR, CacheReuse())
    return _reuse(cache)


def _reuse(cache: Any) -> CacheReuse:
    """The :class:`CacheReuse` of ``cache``, or an empty one not attached to it."""
    found: CacheReuse = getattr(cache, CACHE_ATTR, None) or CacheReuse()
    return found


def held_of(cache: Any) -> HeldDonorStore | None:
    """The held store of ``cache``, or None when it never held a donor."""
    return _reuse(cache).held


@dataclass(frozen=True)
class DonorSlots:
    """Where a donor's KV is: ``path[i]`` is the slot of donor position ``i`` (int64; -1 where
    the donor's KV is not on the device), ``node`` the tree node to lock for the copy (None when
    no position is in the tree)."""

    path: torch.Tensor
    node: Any = None


@dataclass(frozen=True)
class DonorMatchParams:
    """What :meth:`DonorKV.match` is asked: donor ``handle``'s KV for its positions
    ``[0, donor_end)``, in the tree of ``cache`` under the recipient's ``namespace``."""

    cache: Any
    namespace: Namespace
    handle: Hashable
    donor_end: int


@dataclass(frozen=True)
class DonorMatch:
    """:meth:`DonorKV.match`'s answer: ``slots`` covering the asked positions, or the
    ``reason`` (``donor_evicted``, ``donor_on_host``) they cannot be read."""

    slots: DonorSlots | None = None
    reason: str | None = None

    @classmethod
    def missing(cls, reason: str) -> DonorMatch:
        """The donor's KV cannot be read, for ``reason``."""
        return cls(None, reason)


@dataclass(frozen=True)
class PendingKeep:
    """A finished request that reused KV, between its last checkpoint and its row's release:
    what its held donor entry will be registered as (:class:`DonorKV`'s, until ``free_kv_row``)."""

    kv: Any
    rid: str
    namespace: Namespace
    tokens: list[int]


class DonorKV:
    """The donors of one scheduler process: the rid -> handle registry, the held stores' policy
    and counters (``held_donors`` / ``evicted_donors`` in the runtime's snapshot), the head watch,
    where a donor's KV is (:meth:`match`: the tree through the view's ``tree_match``, then the
    held store). Owned by the :class:`~.request_flow.RequestFlow` (``flow.donors``) and called by
    it, the adapters' hooks and substitute mode. Every method may raise; one that took slots
    frees them first (the caller's guard makes the error a counted fallback)."""

    def __init__(
        self,
        provider: SemanticProvider,
        config: Config,
        view: VersionView,
    ) -> None:
        self.provider = provider
        self.config = config
        self._view = view
        self._handles: dict[str, Hashable] = {}  # live donor requests' handles
        self._next_handle = itertools.count()
        self.counts = HeldDonorCounts()
        self.evicted = 0  # donors forgotten when SGLang's eviction freed their head slot
        self._pending: dict[int, PendingKeep] = {}  # by id(req.kv): mark() to take_pending()

    def snapshot(self) -> dict[str, Any]:
        """``held_donors`` (the held stores' counters) and ``evicted_donors``."""
        return {"held_donors": dataclasses.asdict(self.counts), "evicted_donors": self.evicted}

    def register(
        self, namespace: Namespace, rid: str, tokens: Any, *, extend: bool = False
    ) -> list[Hashable]:
        """Index a request's prompt tokens whose KV the engine holds as a donor: once per request,
        or, with ``extend``, replacing the tokens an earlier call registered for ``rid`` (its
        handle is kept). Returns the donors the index dropped to stay within its bound (the
        caller frees what it keeps for them)."""
        handle = self._handles.get(rid)
        if handle is not None and not extend:
            return []
        if handle is None:
            handle = next(self._next_handle)
            self._handles[rid] = handle
        return self.provider.register(namespace, handle, tokens)

    def register_published(
        self, req: Any, published_len: int, cap: int | None, page_size: int
    ) -> None:
        """Index ``req``'s prompt as a donor (once) when the tree holds all of it that it ever
        will: every whole ``page_size`` page of it up to ``published_len`` (at page size 1, all
        of it; with pages the page the prompt ends in is held only once output tokens fill it,
        else it stays with the request and is freed with it). For a request that reused KV
        (``cap``: its publish cap) only its exact head ``prompt[:cap]``: everything after it is
        approximate and was never published."""
        prompt = req.origin_input_ids
        end = len(prompt) if cap is None else min(int(cap), len(prompt))
        held = int(published_len) // page_size * page_size
        if held < end // page_size * page_size:
            return  # more of it is still to be published
        end = min(end, held)
        if end >= self.config.min_prompt_tokens and eligible(req):
            self.register(namespace_for(req), req.rid, list(prompt[:end]))

    def mark_finished(self, req: Any, namespace: Namespace) -> None:
        """``req`` finished having reused KV: with ``keep_reused_donors``, keep the unpublished
        rest of its prompt as a held donor when its row is released (:meth:`keep`)."""
        prompt = req.origin_input_ids
        if (
            self.config.keep_reused_donors
            and len(prompt) >= self.config.min_prompt_tokens
            and eligible(req)
        ):
            self.mark(PendingKeep(req.kv, req.rid, namespace, list(prompt)))

    def handle_of(self, rid: str) -> Hashable | None:
        """The donor handle of live request ``rid``, or None when it is not a donor."""
        return self._handles.get(rid)

    def is_donor(self, handle: Hashable) -> bool:
        """True while ``handle`` is a registered donor."""
        return self.provider.has_donor(handle)

    def tokens(self, handle: Hashable) -> Any:
        """The donor's tokens as the index keeps them, or None when it was dropped."""
        return self.provider.donor_tokens(handle)

    def release(self, rid: str) -> None:
        """Request ``rid`` ended: its handle is no longer looked up by rid (the donor stays)."""
        self._handles.pop(rid, None)

    def forget(self, handle: Hashable, cache: Any = None) -> None:
        """Donor ``handle``'s KV is gone: the index forgets it; given its tree ``cache``, its
        head is unwatched and what the held store kept of it is freed."""
        state = _reuse(cache)
        if state.heads is not None:
            state.heads.unwatch(handle)
        if state.held is not None and state.held.drop(handle):
            self.counts.dropped += 1
            self.counts.tokens = state.held.held_tokens
        self.provider.forget(handle)

    def forget_all(self) -> None:
        """Drop every donor (the engine's cache was reset, so none of their KV exists)."""
        for handle in self.provider.index.handles():
            self.provider.forget(handle)

    def clear(self, cache: Any) -> None:
        """``cache`` is being reset: stop watching heads and free every held donor (the caller
        calls :meth:`forget_all` after the reset)."""
        state = _reuse(cache)
        if state.heads is not None:
            state.heads.clear()
        if state.held is not None:
            self.counts.dropped += len(state.held.clear())
            self.counts.tokens = 0

    def watch_head(self, cache: Any, req: Any) -> None:
        """``req`` was checkpointed: watch its first token's tree slot if it is a donor."""
        handle = self._handles.get(req.rid)
        if handle is None or not self.is_donor(handle):
            return
        state = cache_reuse(cache)
        if state.heads is None:
            state.heads = DonorHeads(self.config.max_donors, self.is_donor)
        if handle not in state.heads:
            slot = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx][0]
            state.heads.watch(handle, int(slot))

    def freed(self, cache: Any, device_frees: Any, component: Any) -> None:
        """SGLang's tree freed ``device_frees`` of ``cache`` (slot tensors per component): note
        the watched heads among those of ``component`` (the full-attention KV)."""
        heads = _reuse(cache).heads
        if heads is not None:
            for slots in device_frees.get(component, ()):
                heads.freed(slots)

    def forget_evicted(self, cache: Any) -> None:
        """After an eviction: forget each donor whose head slot it freed (held donors stay).
        With a host tier (HiCache) a freed device slot may be a demotion, so those donors stay
        until a lookup finds their KV gone. No tree match here: a match splits nodes and
        refreshes their LRU order, which would keep what the eviction is freeing."""
        state = _reuse(cache)
        if state.heads is None:
            return
        freed = state.heads.take_freed()
        if getattr(cache, "cache_controller", None) is not None:
            return
        for handle in freed:
            if self.is_donor(handle) and handle not in (state.held or ()):
                self.forget(handle, cache)
                self.evicted += 1

    def match(self, params: DonorMatchParams) -> DonorMatch:
        """Where donor ``handle``'s KV for its positions [0, donor_end) is: its tokens matched in
        the tree, and for a held donor its held slots after the tree part (-1 where its head
        left the tree). ``donor_on_host`` when HiCache holds the rest in host memory (the donor
        is kept: SGLang's own load-back, an exact hit on it, brings it to the device again);
        ``donor_evicted``, the donor forgotten, when its tokens or its KV are gone."""
        cache, handle, donor_end = params.cache, params.handle, params.donor_end
        donor = self.tokens(handle)
        store = held_of(cache)
        held = None if store is None else store.get(handle)
        if donor is None or len(donor) < donor_end:
            self.forget(handle, cache)
            return DonorMatch.missing(Reason.DONOR_EVICTED)
        tree_end = donor_end if held is None else min(donor_end, held.held_from)
        path = torch.empty(0, dtype=torch.int64)
        node = None
        if tree_end > 0:
            found = self._view.tree_match(TreeMatchParams(cache, params.namespace, donor, tree_end))
            if held is None and found.on_device < donor_end:
                if found.on_device + found.on_host >= donor_end:
                    return DonorMatch.missing(Reason.DONOR_ON_HOST)
                self.forget(handle, cache)
                return DonorMatch.missing(Reason.DONOR_EVICTED)
            if found.on_device > 0:
                path, node = found.slots[: found.on_device], found.node
            if found.on_device < tree_end:  # a held donor whose head left the tree in part
                missing = torch.full((tree_end - found.on_device,), -1, dtype=torch.int64)
                path = torch.cat([path, missing])
        if held is not None and donor_end > held.held_from:
            self.counts.matched += 1
            path = torch.cat([path, held.slots[: donor_end - held.held_from].cpu()])
        return DonorMatch(DonorSlots(path, node))

    def liveness(self, cache: Any, namespace: Namespace) -> DonorAlive | None:
        """The provider's liveness check of candidate donors in ``cache`` under ``namespace``:
        a held donor keeps its whole prompt (its head's slots are checked at the copy); any
        other has the leading tokens the tree still holds, on the device or in host memory
        (SGLang's load-back brings those back). None where the version reads none: the copy
        finds evicted donors."""
        view = self._view
        if not view.checks_donor_liveness:
            return None

        def alive(handle: Any, tokens: Any) -> int:
            if self.holds(cache, handle):
                return len(tokens)
            return view.cached_len(cache, tokens, namespace)

        return alive

    def holds(self, cache: Any, handle: Hashable) -> bool:
        """True while ``cache``'s held store keeps donor ``handle``."""
        return handle in (held_of(cache) or ())

    def held_tokens(self, cache: Any) -> int:
        """Slots held as donor KV outside ``cache``'s tree (0 when it has no store)."""
        store = held_of(cache)
        return 0 if store is None else store.held_tokens

    def mark(self, pending: PendingKeep) -> None:
        """Keep ``pending``'s unpublished prompt KV when its row is released."""
        self._pending[id(pending.kv)] = pending

    def take_pending(self, kv: Any) -> PendingKeep | None:
        """The pending keep of row handle ``kv`` (removed), or None."""
        pending = self._pending.pop(id(kv), None)
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
        store = self._store(cache)
        try:
            held_to = held_from + int(slots.numel())  # the prompt's KV ends here
            dropped = self.register(
                pending.namespace, pending.rid, pending.tokens[:held_to], extend=True
            )
            handle = self.handle_of(pending.rid)
            if handle is None or not self.is_donor(handle):
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

    def _store(self, cache: Any) -> HeldDonorStore:
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
        before = store.held_tokens
        orphans = [h for h in store.handles() if not self.is_donor(h)]
        store.drop_all(orphans)
        freed = before - store.held_tokens
        more, gone = store.evict(num_tokens - freed)
        for handle in gone:
            self.forget(handle)
        self.counts.dropped += len(orphans)
        self.counts.evicted += len(gone)
        self.counts.tokens = store.held_tokens
        return freed + more
