"""What the request flow reads from one family of sglang versions, as data.

A version adapter (:mod:`.unified` for 0.5.22+, :mod:`.legacy` for 0.5.15 - 0.5.18) fills one
:class:`VersionView`; :mod:`.request_flow`, :mod:`.one_pass` and :mod:`.donor_kv` call its
functions and never name a version-specific sglang attribute themselves. The view only reads
sglang: what to do with what it reads (a donor forgotten, a plan declined, admission credit) is
decided by the flow. Nothing here imports sglang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from semblend_sglang.namespace import Namespace

from . import rank_agreement


@dataclass(frozen=True)
class TreeMatchParams:
    """What :attr:`VersionView.tree_match` is asked: the exact tree of ``cache``'s match of
    ``tokens``' positions ``[0, end)`` under ``namespace``."""

    cache: Any
    namespace: Namespace
    tokens: Any
    end: int


@dataclass(frozen=True)
class TreeMatch:
    """:attr:`VersionView.tree_match`'s answer: the first ``on_device`` asked positions have
    device slots ``slots`` (int64), the next ``on_host`` are in host memory (HiCache), and
    ``node`` is the tree node to lock for a copy of the device ones (None when there are none)."""

    on_device: int
    on_host: int = 0
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    node: Any = None


CachedLen = Callable[[Any, Any, Namespace], int]
"""``cached_len(cache, tokens, namespace)``: leading tokens of ``tokens`` the exact tree of
``cache`` holds (device and host), read through the tree's original ``match_prefix``."""


@dataclass(frozen=True)
class VersionView:
    """How one family of sglang versions names what the flow reads; every function only reads.

    ``row_of(req)``: the request's ``req_to_token`` row; ``extend_end(req)``: the end (exclusive)
    of the chunk ``prepare_for_extend`` just laid out; ``lock(cache, node)`` protects a tree path
    from eviction for a copy and returns what ``unlock(cache, receipt)`` takes;
    ``tree_match(params)``: where the tree holds a token sequence's KV (the original match: it
    may split a node, slots do not move); ``serves(cache)``: the adapter's hooks serve this tree
    (its class, no EAGLE keys); ``cached_len``: how much of a sequence the tree holds, for the
    provider's liveness check of candidate donors (None: not read, the copy finds evicted
    donors); ``peers(cache)``: the CPU process groups of the other ranks that run the cache's
    batches (empty for one rank; :mod:`.rank_agreement`); ``paged``: the version's release path
    is served at ``--page-size`` > 1 (the tree publishes and frees whole pages under the publish
    cap; tested on 0.5.23's unified tree only)."""

    row_of: Callable[[Any], int]
    extend_end: Callable[[Any], int]
    lock: Callable[[Any, Any], Any]
    unlock: Callable[[Any, Any], None]
    tree_match: Callable[[TreeMatchParams], TreeMatch]
    serves: Callable[[Any], bool] = lambda cache: True
    cached_len: CachedLen | None = None
    peers: Callable[[Any], list[Any]] = rank_agreement.global_attention_peers
    paged: bool = True
