"""One forward's check-layer state, owned by :class:`.check_layer.LayerHook`: each checked
request's record (:class:`RequestCheck`, its second check :class:`Recheck`), a dense
reference's forced rows (:class:`Forced`), the forward's :class:`ForwardCheck`, and the row
arithmetic over them. Pure data and tensor index math: nothing here touches the model, the
pool or sglang.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from semblend_sglang import recompute
from semblend_sglang.config import Config

from .request_reuse import CheckOutcome


@dataclass
class Recheck:
    """A request's second check: ``rows`` (in the forward's current rows) kept by the first,
    of which ``count`` are kept; the first check's quality-gate ``residual``."""

    rows: torch.Tensor
    count: int
    residual: float


@dataclass
class RequestCheck:
    """One request's check in a forward: its repair ``settings``, its ``recheck_layer``."""

    index: int
    rid: str
    offsets: torch.Tensor
    final: bool
    reference: bool
    reused: int
    pinned: torch.Tensor
    spans: int
    settings: Config
    recheck_layer: int | None = None
    recheck: Recheck | None = None

    def outcome(
        self, recomputed: int, gated: bool, residual: float, rechecked: bool = False
    ) -> CheckOutcome:
        """This request's :class:`.request_reuse.CheckOutcome` (what the check layer reports)."""
        return CheckOutcome(self.rid, recomputed, gated, residual, self.final, rechecked)


@dataclass
class Forced:
    """Dense reference rows (in the forward's current rows) whose K/V are the donor's, read
    from ``slots``, in every layer after ``after``."""

    after: int
    rows: torch.Tensor
    slots: torch.Tensor


@dataclass
class ForwardCheck:
    """One forward's check: armed by ``ForwardBatch.init_new``, bound to the forward whose
    extend lengths are ``extend_lens``. ``select_at``: the layer whose attention selects next
    (None: no more); ``keep``: the rows that stay after layer ``shrink_at``; ``lens``: the
    per-request rows of the forward now; ``forced``: dense reference rows on donor K/V."""

    requests: list[RequestCheck]
    extend_lens: tuple[int, ...]
    select_at: int | None = None
    keep: torch.Tensor | None = None
    shrink_at: int | None = None
    lens: tuple[int, ...] = ()
    positions: torch.Tensor | None = None
    forced: list[Forced] = field(default_factory=list)


def request_starts(check: ForwardCheck) -> list[int]:
    """The first row of each of the batch's requests in the forward of ``check`` (before the
    check layer), by request index."""
    return [0, *itertools.accumulate(check.extend_lens[:-1])]


def drop_unchosen(
    rc: RequestCheck,
    rows: torch.Tensor,
    chosen: torch.Tensor,
    keep: torch.Tensor,
    forced: list[torch.Tensor],
) -> None:
    """The ``rows`` of request ``rc`` not at the indices ``chosen`` leave the batch after this
    check (False in ``keep``), or, for a dense reference, stay on the donor's K/V (``forced``)."""
    dropped = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
    dropped[chosen] = False
    if rc.reference:
        forced.append(rows[dropped])
    else:
        keep[rows[dropped]] = False


def tail_rows(start: int, length: int, offsets: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """The last :data:`~semblend_sglang.recompute.QUERY_TAIL_TOKENS` rows of a request's
    segment that are neither candidates nor pinned (the prompt's own tail)."""
    mine = torch.ones(length, dtype=torch.bool)
    mine[offsets] = False
    mine[pinned] = False
    rows = torch.nonzero(mine).flatten()[-recompute.QUERY_TAIL_TOKENS :]
    return rows + start
