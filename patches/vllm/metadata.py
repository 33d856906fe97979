"""What the scheduler-side connector sends its workers each step: small, picklable load jobs.

Built by :meth:`SchedulerSide.build_meta` from plain ints only (no tensors, no vLLM objects), so
vLLM can pickle or msgspec-serialize it to every worker; the worker turns a job into slot tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Copy donor KV into a recipient's own blocks, K rotated by ``delta`` positions.

    For x in [0, num_tokens): the donor's token at position ``donor_start + x`` (in the blocks
    ``donor_block_ids``, position p in block ``donor_block_ids[p // block_size]``) becomes the
    recipient's token at ``target_start + x`` (in ``target_block_ids``), where
    ``target_start - donor_start == delta``. The scheduler guarantees the donor blocks are held
    (ref-counted) until the recipient finishes and that no target block is a donor block.
    ``failed``: vLLM already counts the tokens as loaded but the scheduler could not plan the
    copy; the worker copies nothing and reports the target blocks as failed loads.
    """

    request_id: str
    donor_block_ids: tuple[int, ...]
    target_block_ids: tuple[int, ...]
    donor_start: int
    target_start: int
    num_tokens: int
    failed: bool = False

    @property
    def delta(self) -> int:
        """Position shift of the donor's keys."""
        return self.target_start - self.donor_start

    def slots(self, block_size: int) -> tuple[list[int], list[int]]:
        """Donor and target slots (``block_id * block_size + offset``) of every token."""
        src, dst = [], []
        for x in range(self.num_tokens):
            p, q = self.donor_start + x, self.target_start + x
            src.append(self.donor_block_ids[p // block_size] * block_size + p % block_size)
            dst.append(self.target_block_ids[q // block_size] * block_size + q % block_size)
        return src, dst

    def target_blocks_written(self, block_size: int) -> set[int]:
        """Ids of the target blocks this job writes (reported as failed if the load fails)."""
        first = self.target_start // block_size
        last = (self.target_start + self.num_tokens - 1) // block_size
        return set(self.target_block_ids[first : last + 1])


@dataclass
class SemBlendConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's load jobs (possibly none)."""

    loads: list[LoadJob] = field(default_factory=list)
