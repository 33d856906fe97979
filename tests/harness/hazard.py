"""THE HAZARD (docs/architecture.md), built on purpose to prove the checker sees it.

A wrapper of the tree's `match_prefix` that, when the exact match is shorter than the donor path,
returns the donor's node and length for a request whose own tokens differ. sglang then puts the
donor's slots in the request's row and publishing the request (`checkpoint()` on 0.5.23,
`cache_unfinished_req` / `cache_finished_req` on the legacy tree) inserts the request's tokens
with them. Never do this in real code. One subclass per tree: they differ only in how a match
result spells its device prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from tests.harness.driver import CacheHarness


class HazardDonorMatch(ABC):
    """Replaces `harness.cache.match_prefix` (on the instance) until `remove`."""

    def __init__(self, harness: CacheHarness, donor_node: Any, donor_len: int) -> None:
        self.cache = harness.cache
        self.original = harness.cache.match_prefix
        self.donor_node = donor_node
        self.donor_len = donor_len
        harness.cache.match_prefix = self

    @abstractmethod
    def _matched(self, result: Any) -> int:
        """Device prefix length of a real match result."""

    @abstractmethod
    def _donor_prefix(self, length: int) -> dict[str, Any]:
        """Match-result fields that claim the donor's first `length` slots."""

    def __call__(self, params: Any) -> Any:
        result = self.original(params)
        if params.req is None or self._matched(result) >= self.donor_len:
            return result
        length = min(self.donor_len, len(params.key) - 1)
        node = self.donor_node
        return result._replace(
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            **self._donor_prefix(length),
        )

    def remove(self) -> None:
        """Restore the real method."""
        del self.cache.match_prefix


class UnifiedHazardDonorMatch(HazardDonorMatch):
    """The hazard on `UnifiedRadixCache` (a match result carries `device_prefix_len`)."""

    def _matched(self, result: Any) -> int:
        return int(result.device_prefix_len)

    def _donor_prefix(self, length: int) -> dict[str, Any]:
        return {"device_prefix_len": length}


class LegacyHazardDonorMatch(HazardDonorMatch):
    """The hazard on the legacy `RadixCache` (a match result carries `device_indices`)."""

    def __init__(self, harness: CacheHarness, donor_node: Any, donor_len: int) -> None:
        path: list[torch.Tensor] = []
        node = donor_node
        while node is not harness.cache.root_node:
            path.insert(0, node.value)
            node = node.parent
        self.donor_slots = torch.cat(path)
        super().__init__(harness, donor_node, donor_len)

    def _matched(self, result: Any) -> int:
        return len(result.device_indices)

    def _donor_prefix(self, length: int) -> dict[str, Any]:
        return {"device_indices": self.donor_slots[:length].clone()}
