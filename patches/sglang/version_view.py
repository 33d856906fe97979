"""What the request flow reads from one family of sglang versions: the protocol and its types.

A version adapter (:mod:`.unified` for 0.5.22+, :mod:`.legacy` for 0.5.15 - 0.5.18) implements
:class:`VersionView` in one class; :mod:`.request_flow`, :mod:`.span_copy` and :mod:`.donor_kv`
call it and never name a version-specific sglang attribute themselves. The view only reads
sglang: what to do with what it reads (a donor forgotten, a plan declined, admission credit) is
decided by the flow. Nothing here imports sglang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from semblend_sglang.namespace import Namespace


@dataclass(frozen=True)
class TreeMatchParams:
    """What :meth:`VersionView.tree_match` is asked: the exact tree of ``cache``'s match of
    ``tokens``' positions ``[0, end)`` under ``namespace``."""

    cache: Any
    namespace: Namespace
    tokens: Any
    end: int


@dataclass(frozen=True)
class TreeMatch:
    """:meth:`VersionView.tree_match`'s answer: the first ``on_device`` asked positions have
    device slots ``slots`` (int64), the next ``on_host`` are in host memory (HiCache), and
    ``node`` is the tree node to lock for a copy of the device ones (None when there are none)."""

    on_device: int
    on_host: int = 0
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    node: Any = None


class VersionView(Protocol):
    """How one family of sglang versions names what the flow reads; every method only reads.

    Implemented by one class per adapter (:class:`.unified.UnifiedView`,
    :class:`.legacy.LegacyView`); :class:`~.request_flow.RequestFlow`, :mod:`.span_copy` and
    :class:`~.donor_kv.DonorKV` hold that object and call it on the scheduler's thread. No
    method changes sglang state beyond the tree's own match (which may split a node; slots do
    not move) and the lock a copy takes; an error raises to the caller, which fails open."""

    paged: bool
    """The version's release path is served at ``--page-size`` > 1 (the tree publishes and
    frees whole pages under the publish cap; tested on 0.5.23's unified tree only)."""
    checks_donor_liveness: bool
    """The provider checks candidate donors with :meth:`cached_len` at lookup (False: the copy
    finds evicted donors)."""

    def row_of(self, req: Any) -> int:
        """The request's ``req_to_token`` row."""
        ...

    def extend_end(self, req: Any) -> int:
        """The end (exclusive) of the chunk ``prepare_for_extend`` just laid out."""
        ...

    def lock(self, cache: Any, node: Any) -> Any:
        """Protect ``node``'s tree path from eviction for a copy; returns what :meth:`unlock`
        takes."""
        ...

    def unlock(self, cache: Any, receipt: Any) -> None:
        """Undo :meth:`lock`."""
        ...

    def tree_match(self, params: TreeMatchParams) -> TreeMatch:
        """Where the tree holds a token sequence's KV (the original match)."""
        ...

    def serves(self, cache: Any) -> bool:
        """The adapter's hooks serve this tree (its class, no EAGLE keys)."""
        ...

    def cached_len(self, cache: Any, tokens: Any, namespace: Namespace) -> int:
        """Leading tokens of ``tokens`` the exact tree of ``cache`` holds (device and host),
        read through the tree's original ``match_prefix``."""
        ...

    def peers(self, cache: Any) -> list[Any]:
        """The CPU process groups of the other ranks that run the cache's batches (empty for
        one rank; :mod:`.rank_agreement`)."""
        ...
