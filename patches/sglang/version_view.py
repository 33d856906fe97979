"""What the request flow reads from one family of sglang versions, as data.

A version adapter (:mod:`.unified` for 0.5.22+, :mod:`.legacy` for 0.5.15 - 0.5.18) fills one
:class:`VersionView`; :mod:`.request_flow` and :mod:`.one_pass` call its functions and never name a
version-specific sglang attribute themselves. Nothing here imports sglang.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from semblend_sglang.lookup_params import DonorAlive
from semblend_sglang.namespace import Namespace

from . import rank_agreement


@dataclass(frozen=True)
class DonorSlots:
    """Where a donor's KV is: ``path[i]`` is the slot of donor position ``i`` (int64; -1 where
    the donor's KV is not on the device), ``node`` the tree node to lock for the copy (None when
    no position is in the tree)."""

    path: torch.Tensor
    node: Any = None


@dataclass(frozen=True)
class DonorMatchParams:
    """What :attr:`VersionView.match_donor` is asked: donor ``handle``'s KV for its positions
    ``[0, donor_end)``, in the tree of ``cache`` under the recipient's ``namespace``."""

    cache: Any
    namespace: Namespace
    handle: Hashable
    donor_end: int


@dataclass(frozen=True)
class DonorMatch:
    """:attr:`VersionView.match_donor`'s answer: ``slots`` covering the asked positions, or
    the ``reason`` (``donor_evicted``, ``donor_on_host``) they cannot be read."""

    slots: DonorSlots | None = None
    reason: str | None = None

    @classmethod
    def missing(cls, reason: str) -> DonorMatch:
        """The donor's KV cannot be read, for ``reason``."""
        return cls(None, reason)


@dataclass(frozen=True)
class VersionView:
    """How one family of sglang versions names what the flow reads.

    ``row_of(req)``: the request's ``req_to_token`` row; ``extend_end(req)``: the end (exclusive)
    of the chunk ``prepare_for_extend`` just laid out; ``lock(cache, node)`` protects a donor's
    tree path from eviction for the copy and returns what ``unlock(cache, receipt)`` takes;
    ``peers(cache)``: the CPU process groups of the other ranks that run the cache's batches
    (empty for one rank; :mod:`.rank_agreement`); ``match_donor(params)``: where a donor's KV is
    (may forget a donor whose KV is gone for good); ``donor_alive(cache, namespace)``: the
    provider's liveness check of candidate donors (None: the copy finds evicted donors);
    ``cache_supported(cache)``: the cache (its tree, pool, page size) can take reused KV;
    ``paged``: the version's release path is served at ``--page-size`` > 1 (the tree publishes
    and frees whole pages under the publish cap; tested on 0.5.23's unified tree only)."""

    row_of: Callable[[Any], int]
    extend_end: Callable[[Any], int]
    lock: Callable[[Any, Any], Any]
    unlock: Callable[[Any, Any], None]
    match_donor: Callable[[DonorMatchParams], DonorMatch]
    cache_supported: Callable[[Any], bool]
    donor_alive: Callable[[Any, Namespace], DonorAlive | None] = lambda cache, namespace: None
    peers: Callable[[Any], list[Any]] = rank_agreement.global_attention_peers
    paged: bool = True
